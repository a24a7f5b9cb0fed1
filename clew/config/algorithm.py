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


class PassAtKConfig(Section):
    """The 'pass_at_k' estimator's subset size (a clew key: SkyRL has no such estimator)."""

    k: int = Field(
        4,
        description="Subset size k of advantage_estimator 'pass_at_k' (Chen et al. 2025, "
        "https://arxiv.org/abs/2508.10751, its analytical derivation): every k-subset of a "
        "group scores 1 if any member passed, and each sample gets the mean GRPO-normalised "
        "score of the subsets holding it, so a failed attempt is pushed down less when the "
        "group also solved. An integer in [1, generator.n_samples_per_prompt - 1]: k = 1 is "
        "GRPO (with the population std), and at k = n_samples_per_prompt a group has one "
        "subset and no signal. Rewards must be 0 or 1 (turn_discount 1, reward_rule 'task'); "
        "norm_adv_by_std_in_grpo and drop_zero_spread_groups apply as to 'grpo'.",
    )


class CispoConfig(Section):
    """CISPO's importance-weight range (SkyRL's ``trainer.algorithm.cispo``)."""

    cispo_eps_clip_low: float = Field(
        1.0,
        ge=0.0,
        description="Each token's detached weight exp(logprob - old logprob) is clipped below "
        "at 1 - cispo_eps_clip_low, >= 0; 1 or more leaves it unbounded below, as in the paper.",
    )
    cispo_eps_clip_high: float = Field(
        4.0,
        ge=0.0,
        description="The weight is clipped above at 1 + cispo_eps_clip_high, >= 0; a token past "
        "it keeps its gradient, weighed at the bound (PPO's clip would drop it).",
    )


class ClipCovConfig(Section):
    """Clip-Cov's token selection (SkyRL's ``trainer.algorithm.clip_cov``)."""

    clip_ratio: float = Field(
        0.0002,
        gt=0.0,
        le=1.0,
        description="Share of a micro-batch's trained tokens, in (0, 1], whose gradient is "
        "removed (at least one), drawn at random among those PPO's clip left alone whose "
        "covariance (A - mean A) * (logprob - mean logprob) lies strictly between clip_cov_lb "
        "and clip_cov_ub.",
    )
    clip_cov_lb: float = Field(
        1.0, description="The candidates' covariance lower bound (below clip_cov_ub)."
    )
    clip_cov_ub: float = Field(
        5.0, description="The candidates' covariance upper bound (above clip_cov_lb)."
    )


class KlCovConfig(Section):
    """KL-Cov's token selection and penalty (SkyRL's ``trainer.algorithm.kl_cov``)."""

    kl_cov_frac: float = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="Share of a micro-batch's trained tokens, in (0, 1], with the largest "
        "covariance (A - mean A) * (logprob - mean logprob), that get the penalty ppo_kl_coef "
        "* |logprob - old logprob| (at least one). SkyRL's default; the authors' verl recipe "
        "uses 0.0002 to 0.002.",
    )
    ppo_kl_coef: float = Field(1.0, ge=0.0, description="Weight of that penalty, >= 0.")


class SapoConfig(Section):
    """SAPO's gate temperatures (SkyRL's ``trainer.algorithm.sapo``)."""

    tau_pos: float = Field(
        1.0,
        gt=0.0,
        description="Temperature, > 0, of the gate (4 / tau) * sigmoid(tau * (ratio - 1)) that "
        "replaces PPO's clip, for tokens with a positive advantage; the larger, the faster a "
        "token's gradient fades as its ratio leaves 1.",
    )
    tau_neg: float = Field(
        1.05,
        gt=0.0,
        description="The gate's temperature, > 0, for tokens with an advantage <= 0 (the "
        "paper's value for Qwen3-30B-A3B; above tau_pos, as those updates destabilise more).",
    )


class AlgorithmConfig(Section):
    advantage_estimator: str = Field(
        "grpo",
        description="How advantages are computed within a group, by registered name: 'grpo' "
        "(reward minus group mean), 'rloo' (reward minus the mean of the others), 'gigpo' "
        "(GRPO per episode plus a per-turn advantage among the group's turns taken from the "
        "same state; clew.algorithms.step_advantages), 'pass_at_k' (each sample's share of "
        "the pass@k of the group's k-subsets; section pass_at_k), or one registered with "
        "clew.algorithms.register_estimator (in a module of environment.modules, or before "
        "the config is loaded).",
    )
    gigpo: GigpoConfig = Field(
        default_factory=GigpoConfig,
        description="Settings of the 'gigpo' estimator (unused by the others).",
    )
    pass_at_k: PassAtKConfig = Field(
        default_factory=PassAtKConfig,
        description="Settings of the 'pass_at_k' estimator (unused by the others).",
    )
    norm_adv_by_std_in_grpo: bool = Field(
        True,
        description="Divide GRPO advantages by the group's reward standard deviation ("
        "'pass_at_k': by that of its k-subsets' rewards).",
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
        description="Policy loss (clew.algorithms.losses, policy_losses, covariance_losses): "
        "'regular' is PPO's clipped objective (registered as 'ppo_clip'); 'gspo' clips one "
        "ratio per sequence, the geometric mean of its tokens' "
        "(https://arxiv.org/abs/2507.18071; the paper's loss_reduction: sequence_mean); 'cispo' "
        "weighs REINFORCE by the clipped, detached ratio (https://arxiv.org/abs/2506.13585; "
        "section cispo); 'clip_cov' and 'kl_cov' clip, or penalise, the tokens whose logprob and "
        "advantage covary most (https://arxiv.org/abs/2505.22617; sections clip_cov and kl_cov; "
        "no use_tis); 'sapo' gates the ratio softly (https://arxiv.org/abs/2511.20347; section "
        "sapo; the paper's loss_reduction: sequence_mean); or a name registered with "
        "clew.algorithms.register_policy_loss (in a module of environment.modules; it takes "
        "ppo_clip_loss's arguments). Dr. GRPO (https://arxiv.org/abs/2503.20783) is 'regular' "
        "with loss_reduction seq_mean_token_sum_norm and norm_adv_by_std_in_grpo false.",
    )
    eps_clip_low: float = Field(
        0.2,
        description="Ratio clip below 1, in (0, 1), of 'regular', 'clip_cov' and 'gspo' (for "
        "'gspo', of the sequence ratio: the paper uses 3e-4).",
    )
    eps_clip_high: float = Field(
        0.2,
        description="Ratio clip above 1, in (0, 1), of 'regular', 'clip_cov' and 'gspo' (for "
        "'gspo' the paper uses 4e-4).",
    )
    clip_ratio_c: float | None = Field(
        None,
        description="Dual-clip bound (> 1) on the ratio for negative advantages; null is off. "
        "Policy loss 'regular' (and registered ones) only.",
    )
    cispo: CispoConfig = Field(
        default_factory=CispoConfig,
        description="Settings of policy_loss_type 'cispo' (CISPO, MiniMax-M1, "
        "https://arxiv.org/abs/2506.13585); unused by the other losses.",
    )
    clip_cov: ClipCovConfig = Field(
        default_factory=ClipCovConfig,
        description="Settings of policy_loss_type 'clip_cov' (Clip-Cov, Cui et al. 2025, "
        "https://arxiv.org/abs/2505.22617); unused by the other losses.",
    )
    kl_cov: KlCovConfig = Field(
        default_factory=KlCovConfig,
        description="Settings of policy_loss_type 'kl_cov' (KL-Cov, Cui et al. 2025, "
        "https://arxiv.org/abs/2505.22617); unused by the other losses.",
    )
    sapo: SapoConfig = Field(
        default_factory=SapoConfig,
        description="Settings of policy_loss_type 'sapo' (SAPO, Gao et al. 2025, "
        "https://arxiv.org/abs/2511.20347); unused by the other losses.",
    )
    loss_reduction: Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="How per-token losses become one number: mean over all tokens, mean of "
        "per-sequence means, or per-sequence sums divided by a fixed length.",
    )
    use_entropy_loss: bool = Field(False, description="Add an entropy bonus to the loss.")
    entropy_loss_coef: float = Field(
        0.01,
        description="Weight of the entropy bonus, >= 0; with entropy_target set, the weight's "
        "starting value (in [entropy_coef_min, entropy_coef_max]).",
    )
    entropy_target: float | None = Field(
        None,
        description="Entropy floor, > 0 (mean token entropy in nats, as policy/entropy), or "
        "null for a fixed entropy_loss_coef. Set, it needs use_entropy_loss: after each "
        "update the bonus's weight moves by entropy_coef_step, up if that update's "
        "policy/entropy was below the target, down if above, within [entropy_coef_min, "
        "entropy_coef_max], and the next update weighs the bonus by it while the entropy is at "
        "or below the target, by 0 above (the floor lifts, never pushes down). Skywork-OR1's "
        "adaptive entropy control (https://arxiv.org/abs/2505.22312; its scripts: target 0.2, "
        "step 0.001, bounds [0, 0.5]), as SAC tunes its temperature to a target entropy "
        "(https://arxiv.org/abs/1812.05905). The weight and the last entropy are checkpointed; "
        "policy/entropy_coef logs the weight each update used.",
    )
    entropy_coef_step: float = Field(
        0.001,
        description="How much, > 0, the entropy bonus's weight moves after each update under "
        "entropy_target (Skywork-OR1's delta_ent_coef).",
    )
    entropy_coef_min: float = Field(
        0.0,
        description="Lowest weight, >= 0, of the entropy bonus under entropy_target.",
    )
    entropy_coef_max: float = Field(
        0.5,
        description="Highest weight, >= entropy_coef_min, of the entropy bonus under "
        "entropy_target.",
    )
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
