"""Per-batch statistics of finished episodes: rewards, solve rate, turns, end reasons, events;
and the stop of a phase whose every episode failed with an env error."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from clew.errors import EnvError
from clew.rollout.trajectory import Trajectory


def rollout_metrics(trajs: Sequence[Trajectory], prefix: str) -> dict[str, float]:
    """Per-batch episode statistics (see ``clew.metrics.catalog`` for their meaning)."""
    n = max(len(trajs), 1)
    out = {
        f"{prefix}/reward_mean": sum(t.reward for t in trajs) / n,
        f"{prefix}/solve_rate": sum(t.success for t in trajs) / n,
        f"{prefix}/turns_mean": sum(t.turns for t in trajs) / n,
        f"{prefix}/episode_tokens_mean": sum(len(t.token_ids) for t in trajs) / n,
        f"{prefix}/generated_tokens_mean": sum(t.generated_tokens for t in trajs) / n,
        f"{prefix}/parse_error_rate": sum(t.parse_errors for t in trajs)
        / max(sum(t.turns for t in trajs), 1),
        f"{prefix}/env_errors": float(sum(t.end_reason == "env_error" for t in trajs)),
        f"{prefix}/waves": float(max((t.wave for t in trajs), default=-1) + 1),
    }
    for reason in sorted({t.end_reason for t in trajs}):
        out[f"{prefix}/end_reason/{reason}"] = sum(t.end_reason == reason for t in trajs) / n
    return out | event_shares(trajs, prefix)


def event_shares(trajs: Sequence[Trajectory], prefix: str) -> dict[str, float]:
    """``{prefix}/event/<event>``: the share of turns whose env info named that ``event``.

    For the maze: moved, wall (a bump: the agent stayed), stop, reached, parse_error. A
    policy that bumps into walls on half its turns reads the walls poorly, which the
    solve rate alone does not show.
    """
    counts: dict[str, int] = {}
    for t in trajs:
        for info in t.infos:
            if (event := info.get("event")) is not None:
                counts[str(event)] = counts.get(str(event), 0) + 1
    total = max(sum(counts.values()), 1)
    return {f"{prefix}/event/{e}": c / total for e, c in sorted(counts.items())}


def stop_if_all_env_errors(trajs: Sequence[Trajectory], phase: str) -> None:
    """Raise an ``EnvError`` when every episode of ``phase`` ended as ``env_error``,
    naming the most common error, how many episodes it ended and the env ids."""
    if not trajs or any(t.end_reason != "env_error" for t in trajs):
        return
    error, count = Counter(t.error or "unknown error" for t in trajs).most_common(1)[0]
    ids = ", ".join(sorted({repr(t.env_id) for t in trajs}))
    raise EnvError(
        f"every one of the {len(trajs)} episodes of {phase} failed with an env error, so "
        f"there is nothing to learn from; stopping. The error ({count} of them): {error} "
        f"(env id(s) {ids}). The checkpoints and exports already written are kept."
    )
