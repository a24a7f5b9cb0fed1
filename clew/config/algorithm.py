"""Configuration of the RL algorithm (``trainer.algorithm.*``): advantages, losses, KL."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from clew.config.section import Section


class DynamicSamplingConfig(Section):
    type: Literal["filter"] | None = Field(
        None,
        description="DAPO's dynamic sampling: 'filter' plays more batches of prompts until "
        "train_batch_size groups with reward spread are in hand and updates on those only "
        "(train/* rollout metrics still cover every episode played); null: off.",
    )
    max_sample_batches: int = Field(
        30,
        description="Most batches of train_batch_size prompts played for one step under "
        "'filter'; at the limit (or when the data runs out) the step updates on the groups "
        "with spread found so far instead of failing. 0 or less: no limit.",
    )


class GigpoConfig(Section):
    gamma: float = Field(
        0.95,
        gt=0.0,
        le=1.0,
        description="Discount of the per-turn returns that GiGPO's step groups compare, in "
        "(0, 1]: below 1, reaching the goal in fewer turns from a state is better.",
    )
    step_advantage_w: float = Field(
        1.0,
        ge=0.0,
        description="Weight of the step-level advantage added to the episode-level one "
        "(0: every turn gets its episode's GRPO advantage).",
    )


class AlgorithmConfig(Section):
    advantage_estimator: str = Field(
        "grpo",
        description="How advantages are computed within a group, by registered name: 'grpo' "
        "(reward minus group mean), 'rloo' (reward minus the mean of the others), 'gigpo' "
        "(GRPO per episode plus a per-turn advantage among the group's turns taken from the "
        "same state; clew.algorithms.step_advantages), or one registered with "
        "clew.algorithms.register_estimator (in a module of environment.modules, or before "
        "the config is loaded).",
    )
    gigpo: GigpoConfig = Field(
        default_factory=GigpoConfig,
        description="Settings of the 'gigpo' estimator (unused by the others).",
    )
    norm_adv_by_std_in_grpo: bool = Field(
        True, description="Divide GRPO advantages by the group's reward standard deviation."
    )
    turn_discount: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Each episode's reward is multiplied by turn_discount ** (turns - 1) "
        "before advantages (and dynamic sampling's spread test), so a solve in fewer turns "
        "ranks above a longer one and groups where every sample solved keep a signal; 1 "
        "leaves rewards as the env gave them. Rollout and eval metrics use the env's reward.",
    )
    drop_zero_spread_groups: bool = Field(
        False,
        description="Leave groups whose rewards are all equal out of the loss (they carry no "
        "signal).",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig,
        description="Sampling more prompts so every update is made of groups with signal.",
    )
    use_kl_loss: bool = Field(
        False, description="Add a KL penalty to the reference (initial) policy to the loss."
    )
    kl_loss_coef: float = Field(0.001, description="Weight of the KL penalty.")
    kl_estimator_type: str = Field(
        "k3",
        description="KL estimator: 'k1' (log-ratio), 'k2' (half its square), 'k3' "
        "(low-variance, non-negative), 'abs', or a name registered with "
        "clew.algorithms.register_kl_estimator (in a module of environment.modules).",
    )
    policy_loss_type: str = Field(
        "regular",
        description="Policy loss: 'regular' is the PPO clipped objective (registered as "
        "'ppo_clip'), or a name registered with clew.algorithms.register_policy_loss (in a "
        "module of environment.modules; it takes ppo_clip_loss's arguments).",
    )
    eps_clip_low: float = Field(0.2, description="PPO ratio clip below 1, in (0, 1).")
    eps_clip_high: float = Field(0.2, description="PPO ratio clip above 1, in (0, 1).")
    clip_ratio_c: float | None = Field(
        None,
        description="Dual-clip bound (> 1) on the ratio for negative advantages; null is off.",
    )
    loss_reduction: Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="How per-token losses become one number: mean over all tokens, mean of "
        "per-sequence means, or per-sequence sums divided by a fixed length.",
    )
    use_entropy_loss: bool = Field(False, description="Add an entropy bonus to the loss.")
    entropy_loss_coef: float = Field(0.01, description="Weight of the entropy bonus.")
    recompute_old_logprobs: bool = Field(
        False,
        description="Score each batch with the trainer's own forward before the update and "
        "use those logprobs as PPO's old policy instead of the engine's sampling logprobs (what "
        "SkyRL and verl always do): one more forward pass over the batch, in micro batches of "
        "micro_forward_batch_size_per_gpu. Every step logs policy/logprob_diff_* (engine "
        "against trainer) either way.",
    )
    use_tis: bool = Field(
        False,
        description="Truncated importance sampling (SkyRL's key): each token's policy loss is "
        "multiplied by min(exp(trainer - engine logprob), tis_imp_ratio_cap), correcting for "
        "the engine sampling from a slightly different distribution than the trainer scores; "
        "implies recompute_old_logprobs.",
    )
    tis_imp_ratio_cap: float = Field(
        -1.0,
        description="Upper bound of the TIS weights; must be > 0 when use_tis is on (e.g. 2.0).",
    )
