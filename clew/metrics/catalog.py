"""The metric names clew's trainer emits, with what each one means.

This is the one home for metric documentation: the docs table (:func:`catalog_markdown`), the
console logger's compact line (the ``short`` labels) and :func:`describe` all read it, so a
metric's meaning is written once. Add an entry here when the trainer starts emitting a new
name.

Names are ``<group>/<metric>``. A name with a ``<placeholder>`` segment is a template for a
family (``timing/<phase>``, ``train/end_reason/<reason>``); :func:`describe` matches concrete
names against it. Per-episode metrics flushed with extremes (see
:meth:`~clew.metrics.collector.MetricsCollector.extend`) also have ``_min`` / ``_max``
companions, which :func:`describe` derives from the ``_mean`` entry instead of listing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

TIMING_PHASES: tuple[str, ...] = (
    "generate",
    "score",
    "advantages",
    "update",
    "evaluate",
    "checkpoint",
    "log",
    "step",
    "dagger",
)

# Phases whose peak device memory the GRPO loop reports, on CUDA devices.
MEMORY_PHASES: tuple[str, ...] = ("generate", "update", "evaluate")


def peak_memory_metric(phase: str) -> str:
    """The metric name of ``phase``'s peak device memory (``perf/peak_memory_gb/<phase>``)."""
    return f"perf/peak_memory_gb/{phase}"


@dataclass(frozen=True)
class MetricSpec:
    """One catalog entry: a name (or template), its meaning, and its console label."""

    name: str
    meaning: str
    # Label in the console logger's one-line summary; "" keeps it out of that line.
    short: str = ""


CATALOG: tuple[MetricSpec, ...] = (
    # train/: the step's rollout batch.
    MetricSpec("train/reward_mean", "Mean episode reward over the step's rollouts.", "reward"),
    MetricSpec(
        "train/solve_rate", "Fraction of the step's episodes that solved the task.", "solve"
    ),
    MetricSpec("train/advantage_mean", "Mean advantage over episodes (near 0 for GRPO)."),
    MetricSpec("train/advantage_std", "Standard deviation of episode advantages."),
    MetricSpec("train/advantage_abs_max", "Largest absolute episode advantage."),
    MetricSpec(
        "train/zero_spread_groups",
        "Groups whose samples all got the same reward (zero advantage, no learning signal).",
    ),
    MetricSpec(
        "train/zero_spread_fraction",
        "Fraction of groups with zero reward spread; rises as the task saturates or stalls.",
        "zero",
    ),
    MetricSpec(
        "train/step_groups",
        "gigpo: step groups (two or more turns of one prompt's episodes taken from the same "
        "state) in the batch.",
    ),
    MetricSpec(
        "train/grouped_turn_fraction",
        "gigpo: share of turns that share their state with another turn of the group (the "
        "others get only the episode-level advantage).",
    ),
    MetricSpec("train/step_group_size_mean", "gigpo: mean turns per step group."),
    MetricSpec(
        "train/turn_advantage_std",
        "gigpo: standard deviation of the per-turn advantages (episode plus step level).",
    ),
    MetricSpec(
        "train/pass_at_k",
        "pass_at_k: mean over the step's groups of the unbiased pass@k estimate 1 - C(N - c, "
        "k) / C(N, k) (c of a group's N samples passed; k = trainer.algorithm.pass_at_k.k), "
        "the objective the estimator raises.",
    ),
    MetricSpec(
        "train/pass_at_k_saturated_groups",
        "pass_at_k: groups with a failure but fewer than k, so that every k-subset holds a "
        "pass: zero advantage although their rewards differ (not in train/zero_spread_groups).",
    ),
    MetricSpec(
        "train/dynamic_sampling/batches",
        "Batches of train_batch_size prompts played for the step (dynamic sampling 'filter'; "
        "1 when the first batch had enough groups with reward spread).",
    ),
    MetricSpec(
        "train/dynamic_sampling/kept_groups",
        "Groups with reward spread the step updated on (dynamic sampling 'filter'); below "
        "train_batch_size when max_sample_batches or the data ran out first.",
    ),
    MetricSpec(
        "train/temperature",
        "Sampling temperature of the step's training rollouts, at which the update scores "
        "them: generator.sampling_params.temperature, or its schedule to temperature_end.",
    ),
    MetricSpec("train/turns_mean", "Mean number of agent turns per episode.", "turns"),
    MetricSpec(
        "train/episode_tokens_mean", "Mean tokens per episode (prompt, observations and actions)."
    ),
    MetricSpec("train/generated_tokens_mean", "Mean model-generated tokens per episode."),
    MetricSpec(
        "train/parse_error_rate", "Fraction of agent turns whose action could not be parsed."
    ),
    MetricSpec("train/env_errors", "Episodes that ended because the environment raised."),
    MetricSpec(
        "train/waves",
        "Engine batches (waves) the step's episodes ran in, on the worker that needed the "
        "most: 1 when the KV cache budget held them all at once. Above 1, a larger "
        "generator.inference_engine.gpu_memory_utilization lets more of them share a wave.",
    ),
    MetricSpec(
        "train/restarts",
        "Worker-group restarts so far after a Ray worker died (trainer.max_restarts), with "
        "every training step.",
    ),
    MetricSpec(
        "train/end_reason/<reason>",
        "Fraction of episodes whose end reason was <reason> (e.g. solved, max_turns, max_tokens).",
    ),
    MetricSpec(
        "train/event/<event>",
        "Fraction of agent turns whose env step reported <event> (maze: moved, wall, stop, "
        "reached, parse_error); a high wall share means the policy misreads the walls.",
    ),
    # policy/: the optimizer update.
    MetricSpec("policy/loss", "Policy loss, averaged over the step's mini-batches.", "loss"),
    MetricSpec(
        "policy/clip_fraction",
        "Fraction of tokens whose ratio was clipped: PPO's clip ('regular'), the sequence "
        "ratio's ('gspo'), the weight's range ('cispo'), PPO's clip or the covariance's "
        "('clip_cov'); 0 for 'kl_cov' and 'sapo' (trainer.algorithm.policy_loss_type).",
    ),
    MetricSpec(
        "policy/approx_kl", "Approximate KL between the rollout and the updated policy.", "kl"
    ),
    MetricSpec("policy/kl_loss", "KL penalty to the reference policy, as added to the loss."),
    MetricSpec("policy/entropy", "Mean token entropy of the policy on generated tokens.", "ent"),
    MetricSpec(
        "policy/entropy_coef",
        "trainer.algorithm.use_entropy_loss: the entropy bonus's weight in the step's loss; "
        "entropy_loss_coef, unless trainer.algorithm.entropy_target is set: then the adaptive "
        "weight (up a step after each update whose policy/entropy was below the target, down "
        "after one above) while the last policy/entropy is at or below the target, 0 above.",
    ),
    MetricSpec("policy/grad_norm", "Gradient norm before clipping.", "gnorm"),
    MetricSpec("policy/lr", "Learning rate used for the step."),
    MetricSpec(
        "policy/skipped_steps",
        "Optimizer steps dropped because the gradient norm was NaN or infinite (should be 0).",
    ),
    MetricSpec(
        "policy/logprob_diff_mean",
        "Mean |engine - trainer| logprob of the rollout's generated tokens: the engine's "
        "sampling logprobs against the trainer's own forward on the same weights and tokens "
        "(clew.train.logprob_guard). 0 up to float rounding when both compute alike; new "
        "kernels, bf16 and merged weights move it. Over every token with "
        "trainer.algorithm.recompute_old_logprobs or use_tis, else over the first "
        "mini-batch's (from the update's own first forward, at no cost).",
        "lpdiff",
    ),
    MetricSpec(
        "policy/logprob_diff_max",
        "Largest |engine - trainer| logprob over the same tokens as policy/logprob_diff_mean "
        "(the largest over the workers).",
    ),
    MetricSpec(
        "policy/logprob_diff_frac_over_0.1",
        "Share of those tokens whose |engine - trainer| logprob exceeds 0.1 (their first-step "
        "PPO ratio is off by more than 10%).",
    ),
    MetricSpec(
        "policy/tis_weight_mean",
        "trainer.algorithm.use_tis: mean truncated importance weight min(exp(trainer - "
        "engine logprob), tis_imp_ratio_cap) over the generated tokens (1 when both agree).",
    ),
    MetricSpec(
        "policy/tis_capped_fraction",
        "trainer.algorithm.use_tis: share of generated tokens whose weight the cap bounds.",
    ),
    # timing/ and throughput/.
    MetricSpec(
        "timing/<phase>",
        "Wall seconds spent in <phase> this step; phases: "
        + ", ".join(TIMING_PHASES)
        + ". A checkpoint or export is saved after its step is logged, so its time is "
        "reported with the next step.",
    ),
    MetricSpec("throughput/episodes_per_s", "Rollout episodes finished per wall second of step."),
    MetricSpec(
        "throughput/generated_tokens_per_s",
        "Model-generated tokens per wall second of step.",
        "tok/s",
    ),
    # perf/: the devices.
    MetricSpec(
        "perf/peak_memory_gb/<phase>",
        "CUDA runs: peak device memory allocated by tensors during <phase> this step, in GB "
        "(10^9 bytes), the largest over the policy workers; phases: "
        + ", ".join(MEMORY_PHASES)
        + ". Not logged on CPU.",
    ),
    # eval/: held-out evaluation, on the steps it runs.
    MetricSpec(
        "eval/all/pass_at_1",
        "Eval solve rate: fraction of eval tasks solved in one attempt (the maze: stopped on "
        "the goal). SkyRL's key of this name counts reward > 0 instead: "
        "eval/all/reward_pass_at_1.",
        "eval",
    ),
    MetricSpec(
        "eval/all/solve_rate",
        "The same share as eval/all/pass_at_1, named for what it counts: eval episodes that "
        "earned the env's task reward.",
    ),
    MetricSpec(
        "eval/all/reward_pass_at_1",
        "SkyRL's eval/all/pass_at_1 (what the SkyRL + VisGym walkthrough reports): fraction "
        "of eval episodes whose reward is above 0. Under the skyrl_visgym reward rule format "
        "credit alone passes, so it can exceed the solve rate; under clew's task rule the two "
        "are equal.",
        "eval_pass_r>0",
    ),
    MetricSpec(
        "eval/all/pass_at_<n>",
        "With n > 1 samples per eval task (generator.eval_n_samples_per_prompt): fraction of "
        "eval tasks solved by at least one of their n samples; pass_at_1 is then the mean "
        "over all samples.",
    ),
    MetricSpec("eval/all/mean_turns", "Mean agent turns per eval episode."),
    MetricSpec("eval/all/parse_error_rate", "Fraction of eval turns whose action failed to parse."),
    MetricSpec(
        "eval/all/event/<event>",
        "Fraction of eval turns whose env step reported <event> (as train/event/<event>).",
    ),
    MetricSpec(
        "eval/all/solvable_ceiling",
        "Fraction of eval tasks solvable within the turn budget (the best pass@1 can reach).",
    ),
    MetricSpec(
        "eval/agreement/<group>",
        "SFT evaluations: share of turns on the solver's own path where the policy's most "
        "likely action is an optimal one (clew.trainer.agreement); groups: all, corridor, "
        "junction, dead_end, goal, dist_0_3, dist_4_7, dist_8_11, dist_12_plus.",
    ),
    # select/: the selection set (data.select_data), played with each GRPO evaluation.
    MetricSpec(
        "select/all/<metric>",
        "The selection set's figures, each as eval/all/<metric> is of the eval set; "
        "select/all/pass_at_1 picks the policy trainer.export_best keeps.",
    ),
    # sft/: the SFT stage (`clew sft`, clew.trainer.sft).
    MetricSpec(
        "sft/loss", "Cross-entropy of the expert's replies (token mean over the batch).", "sft_loss"
    ),
    MetricSpec("sft/token_accuracy", "Share of the expert's reply tokens the policy ranks first."),
    MetricSpec("sft/tokens", "Loss tokens (the expert's reply tokens) in the step's batch."),
    MetricSpec("sft/grad_norm", "Global gradient norm before clipping."),
    MetricSpec("sft/lr", "Learning rate of the step's optimizer step."),
    MetricSpec("sft/skipped", "1 when the gradient was NaN or infinite and the step was skipped."),
    MetricSpec("sft/elapsed_s", "Wall seconds since the run (or its resume) started."),
    MetricSpec("sft/dagger_solve_rate", "DAgger round: share of the policy's episodes solved."),
    MetricSpec("sft/dagger_demonstrations", "DAgger round: branch demonstrations the round made."),
    MetricSpec("sft/dagger_pool", "DAgger round: branch demonstrations the batches draw from."),
    MetricSpec("sft/dagger_s", "DAgger round: wall seconds it took."),
    # metrics/: about the metrics themselves.
    MetricSpec(
        "metrics/non_finite", "Metric values this step that were NaN or infinite (should be 0)."
    ),
)

# Console line order: the step's outcome first, then optimizer health, then speed.
_HEADLINE_ORDER = (
    "train/reward_mean",
    "train/solve_rate",
    "eval/all/pass_at_1",
    "eval/all/reward_pass_at_1",
    "train/zero_spread_fraction",
    "train/turns_mean",
    "policy/loss",
    "policy/approx_kl",
    "policy/entropy",
    "policy/grad_norm",
    "throughput/generated_tokens_per_s",
)
_SHORT = {m.name: m for m in CATALOG if m.short}
# Anything given a short label but not placed above goes at the end rather than vanishing.
HEADLINE: tuple[MetricSpec, ...] = (
    tuple(_SHORT[n] for n in _HEADLINE_ORDER)
    + tuple(m for n, m in _SHORT.items() if n not in _HEADLINE_ORDER)
    + (MetricSpec("timing/step", "Wall seconds of the whole step.", "step_s"),)
)

_PLACEHOLDER = re.compile(r"<([a-z_]+)>")


@cache
def _templates() -> tuple[tuple[re.Pattern[str], MetricSpec], ...]:
    out = []
    for spec in CATALOG:
        if "<" not in spec.name:
            continue
        parts = _PLACEHOLDER.split(spec.name)
        # split() alternates literal text and placeholder names.
        regex = "".join(
            re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^/]+)" for i, p in enumerate(parts)
        )
        out.append((re.compile(regex + "$"), spec))
    return tuple(out)


_BY_NAME = {m.name: m for m in CATALOG}


def lookup(name: str) -> MetricSpec | None:
    """The catalog entry for ``name``: an exact entry, else the template it matches."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    for regex, spec in _templates():
        if regex.match(name):
            return spec
    return None


def describe(name: str) -> str | None:
    """One-line meaning of a concrete metric name, or ``None`` if the catalog lacks it.

    Templates are filled in (``timing/update`` -> "Wall seconds spent in update ..."), and
    ``_min`` / ``_max`` companions of a ``_mean`` metric are described from it.
    """
    if name in _BY_NAME:
        return _BY_NAME[name].meaning
    for regex, spec in _templates():
        match = regex.match(name)
        if match:
            meaning = spec.meaning
            for key, value in match.groupdict().items():
                meaning = meaning.replace(f"<{key}>", value)
            return meaning
    for suffix, word in (("_min", "Smallest"), ("_max", "Largest")):
        if name.endswith(suffix):
            base = describe(name.removesuffix(suffix) + "_mean")
            if base is not None:
                return f"{word} per-episode value of: {base[0].lower()}{base[1:]}"
    return None


def catalog_markdown() -> str:
    """The catalog as Markdown: one table per metric group, ready for the docs."""
    lines = [
        "# Metrics",
        "",
        "Every metric clew's trainer logs, by group. `<...>` marks a family of names;",
        "`*_mean` metrics logged with extremes also have `*_min` / `*_max` companions.",
    ]
    group = None
    for spec in CATALOG:
        head = spec.name.split("/", 1)[0]
        if head != group:
            group = head
            lines += ["", f"## {group}/", "", "| Metric | Meaning |", "| --- | --- |"]
        # Bare <reason> would be read as an HTML tag and vanish from the rendered table.
        meaning = _PLACEHOLDER.sub(r"`<\1>`", spec.meaning.replace("|", r"\|"))
        lines.append(f"| `{spec.name}` | {meaning} |")
    return "\n".join(lines) + "\n"
