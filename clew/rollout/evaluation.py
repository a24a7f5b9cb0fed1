"""Evaluation: play every eval maze, greedily or sampled, and report the task success rate.

``eval/all/pass_at_1`` is the share of episodes that earned the env's success reward; no
format reward enters it. With n > 1 samples a maze (``eval_n_samples_per_prompt``) it is
the mean over all samples, the unbiased estimate of one attempt's success, and
``eval/all/pass_at_<n>`` is the share of mazes that at least one of their n samples solved.
``eval/all/solve_rate`` is the same share under a name that says what it counts.
The solvable ceiling (the share of rows whose expert play fits in the turn budget; rows
of an env without an expert count as solvable) is reported beside it so a solve rate can
be read against its limit.

SkyRL's ``eval/all/pass_at_1`` (the number the SkyRL + VisGym walkthrough reports) counts
a trajectory whose *reward* is above 0 (``clew.envs.rewards.passes``), which under its
reward rule includes format credit alone; clew reports that share as
``eval/all/reward_pass_at_1``, always beside the solve rate (``headline``), so the two
can be read together. Under clew's own reward rule they are equal.

Every trajectory is dumped as JSONL and a few as GIFs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from clew.data.rows import Row
from clew.envs.media import replay, write_episode
from clew.envs.rewards import passes
from clew.inference.engine import InferenceEngine
from clew.rollout.episode_stats import event_shares
from clew.rollout.loop import RolloutSettings, play
from clew.rollout.trajectory import Trajectory


def eval_metrics(
    trajs: Sequence[Trajectory], rows: Sequence[Row], max_turns: int
) -> dict[str, float]:
    n = max(len(trajs), 1)
    turns = max(sum(t.turns for t in trajs), 1)
    ceiling = sum(r.solvable_within(max_turns) for r in rows) / max(len(rows), 1)
    solve_rate = sum(t.success for t in trajs) / n
    return {
        "eval/all/pass_at_1": solve_rate,
        "eval/all/solve_rate": solve_rate,
        "eval/all/reward_pass_at_1": sum(passes(t.reward) for t in trajs) / n,
        **pass_at_n(trajs),
        "eval/all/mean_reward": sum(t.reward for t in trajs) / n,
        "eval/all/mean_turns": sum(t.turns for t in trajs) / n,
        "eval/all/parse_error_rate": sum(t.parse_errors for t in trajs) / turns,
        "eval/all/solvable_ceiling": ceiling,
        "eval/all/episodes": float(len(trajs)),
    } | event_shares(trajs, "eval/all")


def headline(metrics: dict[str, float]) -> str:
    """One line with the walkthrough's pass rule and clew's solve rate side by side (and
    the ceiling the turn budget sets), for the printed summary of an evaluation."""
    parts = [
        f"pass_at_1 (reward > 0, SkyRL's rule): {metrics['eval/all/reward_pass_at_1']:.4f}",
        f"solve rate (stopped on the goal): {metrics['eval/all/solve_rate']:.4f}",
    ]
    if "eval/all/solvable_ceiling" in metrics:
        parts.append(f"solvable ceiling: {metrics['eval/all/solvable_ceiling']:.4f}")
    return " | ".join(parts)


def pass_at_n(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``eval/all/pass_at_<n>`` when each maze was played n > 1 times (groups by prompt)."""
    groups: dict[int, list[bool]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t.success)
    sizes = {len(g) for g in groups.values()}
    if not groups or max(sizes) < 2:
        return {}
    # Groups are equal-sized unless an episode errored out; name the metric by the largest.
    n = max(sizes)
    return {f"eval/all/pass_at_{n}": sum(any(g) for g in groups.values()) / len(groups)}


def evaluate(
    engine: InferenceEngine,
    rows: Sequence[Row],
    settings: RolloutSettings,
    *,
    output_dir: str | Path | None = None,
    num_gifs: int = 4,
    show_progress: bool = True,
    seed: int = 0,
) -> tuple[dict[str, float], list[Trajectory]]:
    """Metrics and trajectories of one pass over ``rows``; dumps them under ``output_dir``."""
    total = len(rows) * settings.n_samples_per_prompt
    with tqdm(total=total, desc="eval episodes", disable=not show_progress, unit="ep") as bar:
        trajs = play(engine, rows, settings, seed=seed, progress=bar.update)
    metrics = eval_metrics(trajs, rows, settings.max_turns)
    if output_dir is not None:
        dump_eval(trajs, metrics, Path(output_dir), num_gifs)
    return metrics, trajs


def dump_eval(
    trajs: Sequence[Trajectory], metrics: dict[str, float], out: Path, num_gifs: int
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "trajectories.jsonl").open("w") as f:
        for t in trajs:
            f.write(json.dumps(t.record()) + "\n")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    solved = [t for t in trajs if t.success][: (num_gifs + 1) // 2]
    failed = [t for t in trajs if not t.success][: num_gifs - len(solved)]
    for t in solved + failed:
        tag = "solved" if t.success else "failed"
        stem = out / "gifs" / f"{tag}_seed{t.seed}_s{t.sample_index}"
        write_episode(replay(t.env_id, t.seed, t.actions, t.env_options), stem)
