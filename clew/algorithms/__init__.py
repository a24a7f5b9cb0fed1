"""RL algorithm math: advantages, policy losses, KL penalties, token statistics, entropy
controls.

Pure functions on torch tensors (on floats for the per-step entropy controls), independent
of models, Ray and rollout code, so the numerics of training can be tested on CPU in
milliseconds. Each family is a registry keyed by
the config name (``grpo``, ``ppo_clip``, ``gspo``, ``k3``, ...); add a variant with its ``register_*``
decorator rather than a subclass. An advantage estimator registered with
:func:`register_estimator` also says what it needs from the rollouts (see
``clew.algorithms.estimators``); register it before ``clew.config.load_config`` so the config
accepts its name.
"""

from clew.algorithms.advantages import (
    grpo_advantages,
    rloo_advantages,
    token_advantages,
    turn_discounted_rewards,
)
from clew.algorithms.covariance_losses import clip_cov_loss, kl_cov_loss
from clew.algorithms.entropy_control import (
    adapt_entropy_coef,
    entropy_coef_in_effect,
    linear_schedule,
)
from clew.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    ROLLOUT_NEEDS,
    AdvantageResult,
    EstimatorBatch,
    EstimatorSettings,
    EstimatorSpec,
    compute_advantages,
    estimator_names,
    get_estimator,
    register_estimator,
    setting,
)
from clew.algorithms.kl import (
    KL_ESTIMATORS,
    KL_LOG_RATIO_CLAMP,
    get_kl_estimator,
    kl_loss,
    kl_penalty,
    register_kl_estimator,
)
from clew.algorithms.logprob_gap import (
    LOGPROB_DIFF_THRESHOLD,
    LogprobGap,
    tis_weights,
)
from clew.algorithms.losses import (
    LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    REDUCTIONS,
    compute_policy_loss,
    get_policy_loss,
    policy_loss_name,
    ppo_clip_loss,
    reduce_loss,
    register_policy_loss,
)
from clew.algorithms.pass_at_k import pass_at_k_advantages
from clew.algorithms.policy_losses import cispo_loss, gspo_loss, sapo_loss
from clew.algorithms.stats import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
)
from clew.algorithms.step_advantages import (
    discounted_returns,
    gigpo_advantages,
    step_advantages,
    turn_token_advantages,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "KL_LOG_RATIO_CLAMP",
    "LOGPROB_DIFF_THRESHOLD",
    "LOG_RATIO_CLAMP",
    "POLICY_LOSSES",
    "REDUCTIONS",
    "ROLLOUT_NEEDS",
    "AdvantageResult",
    "EstimatorBatch",
    "EstimatorSettings",
    "EstimatorSpec",
    "LogprobGap",
    "adapt_entropy_coef",
    "cispo_loss",
    "clip_cov_loss",
    "compute_advantages",
    "compute_policy_loss",
    "discounted_returns",
    "entropy_coef_in_effect",
    "entropy_from_logits",
    "estimator_names",
    "get_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "policy_loss_name",
    "gigpo_advantages",
    "grpo_advantages",
    "gspo_loss",
    "kl_cov_loss",
    "kl_loss",
    "kl_penalty",
    "linear_schedule",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "pass_at_k_advantages",
    "ppo_clip_loss",
    "reduce_loss",
    "register_estimator",
    "register_kl_estimator",
    "register_policy_loss",
    "rloo_advantages",
    "sapo_loss",
    "setting",
    "step_advantages",
    "tis_weights",
    "token_advantages",
    "turn_discounted_rewards",
    "turn_token_advantages",
]
