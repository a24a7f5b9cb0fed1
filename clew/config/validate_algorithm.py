"""The rules of the algorithm's newer settings: the policy losses beyond PPO's clip, pass@k
advantages, the entropy floor and the temperature schedule (``clew.config.validate`` runs
them with its other rules; each reports through its ``fail(rule, message)``)."""

from __future__ import annotations

from collections.abc import Callable

from clew.config.schema import ClewConfig

# The built-in losses other than PPO's clip (clew.algorithms.policy_losses): none has a dual
# clip, and the covariance ones take no truncated importance sampling (nor do SkyRL's).
_OWN_CLIP_LOSSES = ("gspo", "cispo", "clip_cov", "kl_cov", "sapo")
_NO_TIS_LOSSES = ("clip_cov", "kl_cov")


def policy_loss_rules(cfg: ClewConfig, fail: Callable[[str, str], None]) -> None:
    """The policy loss's own settings, and the shared keys a built-in loss would ignore."""
    alg = cfg.trainer.algorithm
    name, key = alg.policy_loss_type, "trainer.algorithm"
    if not (lb := alg.clip_cov.clip_cov_lb) < (ub := alg.clip_cov.clip_cov_ub):
        fail(
            "clip-cov-bounds",
            f"{key}.clip_cov.clip_cov_lb ({lb}) must be below {key}.clip_cov.clip_cov_ub ({ub})",
        )
    if name in _OWN_CLIP_LOSSES and alg.clip_ratio_c is not None:
        fail(
            "clip-ratio-c",
            f"{key}.clip_ratio_c (dual clip, {alg.clip_ratio_c}) applies to policy_loss_type "
            f"'regular' only; {name!r} has no dual clip: set it to null",
        )
    if name in _NO_TIS_LOSSES and alg.use_tis:
        fail(
            "loss-tis",
            f"{key}.use_tis is not supported with policy_loss_type {name!r} (nor by SkyRL); "
            f"accepted with: 'regular', 'gspo', 'cispo', 'sapo'",
        )


def pass_at_k_rules(cfg: ClewConfig, fail: Callable[[str, str], None]) -> None:
    """Estimator 'pass_at_k': k leaves a group two subsets or more, and rewards stay 0 or 1."""
    alg, key = cfg.trainer.algorithm, "trainer.algorithm"
    n, k = cfg.generator.n_samples_per_prompt, alg.pass_at_k.k
    if n >= 2 and not 1 <= k <= n - 1:
        fail(
            "pass-at-k",
            f"{key}.pass_at_k.k must be in [1, generator.n_samples_per_prompt - 1] = [1, {n - 1}] "
            f"for advantage_estimator 'pass_at_k', got {k}"
            + (
                f": at k = n_samples_per_prompt ({n}) a group is one k-subset, with nothing to "
                "compare it with, so every advantage would be zero"
                if k == n
                else ""
            ),
        )
    if alg.turn_discount != 1.0:
        fail(
            "pass-at-k",
            f"{key}.turn_discount ({alg.turn_discount}) makes a solve worth less than 1, but "
            "advantage_estimator 'pass_at_k' needs rewards of 0 or 1: set turn_discount to 1",
        )
    if (rule := cfg.environment.reward_rule) != "task":
        fail(
            "pass-at-k",
            f"environment.reward_rule {rule!r} pays partial credit, but {key}."
            "advantage_estimator 'pass_at_k' needs rewards of 0 or 1: use reward_rule 'task'",
        )


def entropy_floor_rules(cfg: ClewConfig, fail: Callable[[str, str], None]) -> None:
    """The adaptive entropy coefficient's target, step and bounds (``entropy_target``)."""
    alg, key = cfg.trainer.algorithm, "trainer.algorithm"
    if not alg.entropy_coef_step > 0:
        fail("entropy-floor", f"{key}.entropy_coef_step must be > 0, got {alg.entropy_coef_step}")
    lo, hi = alg.entropy_coef_min, alg.entropy_coef_max
    if not 0 <= lo <= hi:
        fail(
            "entropy-floor",
            f"{key}.entropy_coef_min ({lo}) and entropy_coef_max ({hi}) must satisfy "
            "0 <= entropy_coef_min <= entropy_coef_max",
        )
    if (target := alg.entropy_target) is None:
        return
    if not target > 0:
        fail(
            "entropy-floor",
            f"{key}.entropy_target must be > 0 (a mean token entropy in nats) or null for "
            f"off, got {target}",
        )
    if not alg.use_entropy_loss:
        fail(
            "entropy-floor",
            f"{key}.entropy_target ({target}) adapts the entropy bonus's weight, but "
            f"{key}.use_entropy_loss is false: set it to true (entropy_loss_coef is the "
            "weight's starting value), or entropy_target to null",
        )
    elif 0 <= lo <= hi and not lo <= alg.entropy_loss_coef <= hi:
        fail(
            "entropy-floor",
            f"{key}.entropy_loss_coef ({alg.entropy_loss_coef}), the starting weight under "
            f"entropy_target, must lie in [entropy_coef_min, entropy_coef_max] = [{lo}, {hi}]",
        )


def temperature_schedule_rules(cfg: ClewConfig, fail: Callable[[str, str], None]) -> None:
    """``temperature_end``: training rollouts only, from and to a temperature > 0."""
    gen, key = cfg.generator, "generator.sampling_params"
    if (end := gen.eval_sampling_params.temperature_end) is not None:
        fail(
            "temperature-schedule",
            f"generator.eval_sampling_params.temperature_end ({end}) must be null: the "
            "temperature schedule is for training rollouts; evaluation keeps "
            "eval_sampling_params.temperature",
        )
    if (end := gen.sampling_params.temperature_end) is None:
        return
    if not end > 0:
        fail(
            "temperature-schedule",
            f"{key}.temperature_end must be > 0, or null for a constant temperature; got {end}",
        )
    if not (start := gen.sampling_params.temperature) > 0:
        fail(
            "temperature-schedule",
            f"{key}.temperature_end ({end}) schedules from {key}.temperature, which must then "
            f"be > 0 (0 is greedy, with no distribution to anneal); got {start}",
        )
