"""What ``clew play`` and ``clew eval --endpoint`` say after the episodes, beside the metrics.

* ``parse_hint``: when most replies could not be read as actions, why. The usual cause is
  a mismatch between how the policy answers and what the env reads: the maze reads one
  action format (its option ``action_format``: VisGym's tuples ``('move', 1)`` by default,
  or keywords ``<action>up</action>``), and a policy trained on the other, or flags
  (``--reply-prefix '<action>' --allowed-tokens up,...``) that write the other, gets a
  parse error on every turn. The hint names the option that makes the env read what the
  replies hold.
* ``cut_short_note``: how many episodes the server cut short, and its first reason.
* ``image_limit_note``: that the server's image limit left older frames out of requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from clew.rollout.trajectory import Trajectory

# Reply parsers of the maze's prompt formats that read tuple actions only (VisGym's and
# SkyRL's); clew's ("last") reads either action format.
_TUPLE_ONLY_PARSERS = ("visgym", "skyrl")


def option_flags(options: dict[str, str]) -> str:
    """``clew play``'s flags that set ``options``."""
    return " ".join(f"--option {k}={v}" for k, v in options.items())


def dataset_advice(options: dict[str, str]) -> str:
    """How ``clew eval`` gets ``options``: the eval set's rows carry their env options, and
    ``--prompt-format`` sets the prompt format over them."""
    rest = {k: v for k, v in options.items() if k != "prompt_format"}
    fmt = options.get("prompt_format")
    parts = (
        [f"make the eval set with `clew dataset --split eval {option_flags(rest)}`"] if rest else []
    )
    if fmt:
        parts.append(f"pass --prompt-format {fmt}")
    return " and ".join(parts)


def play_advice(options: dict[str, str]) -> str:
    """How ``clew play`` gets ``options``."""
    return f"add {option_flags(options)}"


def parse_hint(
    trajs: Sequence[Trajectory], advice: Callable[[dict[str, str]], str] = play_advice
) -> str | None:
    """Why most replies of ``trajs`` did not parse, with the env options that would read
    them (``advice`` words how to set them); None when most replies parsed."""
    failed = [(t, i) for t in trajs for i, info in enumerate(t.infos) if info.get("parse_error")]
    turns = sum(len(t.infos) for t in trajs)
    if not failed or 2 * len(failed) <= turns:
        return None
    traj, i = failed[0]
    note = str(traj.infos[i].get("note") or "no reason given")
    reply = traj.actions[i]
    if reply.strip()[:20] not in note:  # the maze's own note quotes the reply already
        note = f"{_shown(reply)}: {note}"
    text = (
        f"{len(failed)} of {turns} replies could not be read as {traj.env_id} actions "
        f"(seed {traj.seed}, turn {i + 1}: {note})."
    )
    reads, parser = _env_reads(traj)
    if reads is None:
        return (
            f"{text} Check --reply-prefix, --reply-suffix and --allowed-tokens against the "
            "replies the env reads (its prompt says how to answer), and the env options "
            "against those the policy was trained with."
        )
    looks = _looks_like([t.actions[j] for t, j in failed], reads)
    if looks is None:
        return (
            f"{text} This env reads {reads} actions (env option action_format) and the "
            "replies look like neither format (as an untrained policy's may): check --reply-prefix, --reply-suffix and "
            "--allowed-tokens, and the env options the policy was trained with."
        )
    wanted = {"action_format": looks}
    if looks == "keyword" and parser in _TUPLE_ONLY_PARSERS:
        wanted["prompt_format"] = "clew"  # its reply parser reads keyword actions
    return (
        f"{text} They look like {looks} actions, but this env reads {reads} actions (env "
        f"option action_format, 'tuple' unless set): {advice(wanted)} if the policy was "
        "trained so."
    )


def cut_short_note(trajs: Sequence[Trajectory]) -> str | None:
    """How many episodes the server cut short and the first one's reason; None if none."""
    cut = [t for t in trajs if t.end_reason == "server_error"]
    if not cut:
        return None
    return (
        f"{len(cut)} of {len(trajs)} episodes were cut short by the server after the turns "
        f"they had played ({cut[0].error})"
    )


def image_limit_note(max_images: int) -> str:
    """That requests left frames out to keep within the server's limit of ``max_images``."""
    return (
        f"the server takes at most {max_images} images per request: past {max_images} "
        "frames, earlier turns were sent with their text alone (as --keep-last-k-images "
        f"{max_images}); a server started with a larger --max-images gets every frame"
    )


def _env_reads(traj: Trajectory) -> tuple[str | None, str | None]:
    """The action format the episode's env reads and its prompt format's reply parser
    (None, None for an env without action formats)."""
    from clew.envs import make

    try:
        env: Any = make(traj.env_id, **traj.env_options)
    except Exception:  # the hint is best effort: an env that cannot be made names nothing
        return None, None
    reads = getattr(env, "action_format", None)
    parser = getattr(getattr(env, "format", None), "reply_parser", None)
    return (reads if isinstance(reads, str) else None), parser


def _looks_like(replies: list[str], reads: str) -> str | None:
    """The other action format that reads most of ``replies``, if one does."""
    from clew.envs.maze.actions import ACTION_FORMATS, Action, parse_action

    for other in ACTION_FORMATS:
        if other == reads:
            continue
        read = sum(isinstance(parse_action(r, other), Action) for r in replies)
        if 2 * read > len(replies):
            return other
    return None


def _shown(reply: str) -> str:
    return repr(reply if len(reply) <= 60 else reply[:57] + "...")
