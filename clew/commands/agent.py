"""``clew play`` (one episode through an endpoint, as a GIF) and what ``clew eval`` shares
with it: the generation flags, read into the rollouts' ``RolloutSettings``, and
``clew eval --endpoint``.

Both write what they played even when the server cut episodes short (a later turn's
request refused or failed: ``server_error``), and then exit 1 rather than 0; after the
episodes they say, on stderr, why most replies did not parse where they did not
(``clew.agent.hints``) and whether the server's image limit left frames out.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from clew.agent.flags import (
    API_KEY_ENV,
    add_generation_args,
    positive_int,
    rollout_settings,
)
from clew.commands.registry import Handler, _add_env_args, _env_options, command


def add_endpoint_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument(
        "--endpoint",
        required=required,
        metavar="URL",
        help="an OpenAI-compatible server (`clew serve`), e.g. http://127.0.0.1:8000",
    )
    p.add_argument(
        "--api-key", default=None, help=f"the server's API key (default: ${API_KEY_ENV})"
    )
    p.add_argument(
        "--max-images-per-request",
        type=positive_int,
        default=None,
        metavar="N",
        help="the most images one request to the endpoint holds; beyond it older turns are "
        "sent with their text alone, as --keep-last-k-images does. Default: every frame, until "
        "the server refuses a request for its image limit (clew serve --max-images, 8 unless "
        "set), which its answer names and later requests keep within; set it for a server "
        "whose refusal names no limit",
    )


def endpoint(args: argparse.Namespace) -> Any:
    from clew.agent import Endpoint

    return Endpoint(
        args.endpoint,
        args.model,
        api_key=args.api_key or os.environ.get(API_KEY_ENV),
        max_images=args.max_images_per_request,
    )


def eval_through_endpoint(
    args: argparse.Namespace,
    rows: list,
    settings: Any,
    show: Callable[[dict[str, float], str], None],
) -> int:
    """``clew eval --endpoint``: the eval set's episodes as requests, ``--concurrency`` at
    once; ``show`` prints the metrics. The exit status: 1 when the server cut episodes
    short (what was played is written all the same), else 0."""
    from clew.agent import evaluate_endpoint
    from clew.agent.hints import dataset_advice

    served = endpoint(args)
    metrics, trajs = evaluate_endpoint(
        served,
        rows,
        settings,
        concurrency=args.concurrency,
        output_dir=args.output_dir,
        num_gifs=args.num_gifs,
        seed=args.seed,
    )
    show(metrics, args.output_dir)
    return _after_episodes("eval", served, trajs, dataset_advice)


def _after_episodes(
    command: str, served: Any, trajs: Sequence[Any], advice: Callable[[dict[str, str]], str]
) -> int:
    """Say on stderr what the episodes' outcome leaves unsaid; the exit status."""
    from clew.agent.hints import cut_short_note, image_limit_note, parse_hint

    notes = [
        ("hint", parse_hint(trajs, advice)),
        ("note", image_limit_note(served.max_images) if served.images_left_out else None),
        ("warning", cut_short_note(trajs)),
    ]
    for kind, text in notes:
        if text:
            print(f"clew {command}: {kind}: {text}", file=sys.stderr)
    return 1 if any(t.end_reason == "server_error" for t in trajs) else 0


@command("play", "play one episode with a served policy (clew serve) and write it as a GIF")
def _play(p: argparse.ArgumentParser) -> Handler:
    add_endpoint_args(p, required=True)
    p.add_argument("--model", required=True, help="the served model: ID, or ID:ADAPTER")
    _add_env_args(p)
    p.add_argument("--seed", type=int, default=0, help="the env's seed (which maze)")
    p.add_argument("--gif", default=None, help="write the episode to this GIF")
    add_generation_args(p)
    p.add_argument("--sampling-seed", type=int, default=0, help="with --temperature > 0")

    def run(args: argparse.Namespace) -> int:
        from clew.agent import play_episode
        from clew.agent.hints import play_advice
        from clew.envs import make
        from clew.envs.media import replay, write_gif

        options = _env_options(args)
        env_max_turns = int(getattr(make(args.env_id, **options), "max_turns", 1 << 30))
        settings = rollout_settings(args, env_max_turns)
        served = endpoint(args)
        served.check()

        def show(traj: Any) -> None:
            info = traj.infos[-1] if traj.infos else {}
            note = info.get("event") or info.get("note") or traj.end_reason
            print(f"turn {traj.turns}: {traj.actions[-1]!r} -> {note}")

        traj = play_episode(
            served,
            args.env_id,
            options,
            args.seed,
            settings,
            sampling_seed=args.sampling_seed,
            on_turn=show,
        )
        outcome = "solved" if traj.success else "not solved"
        error = f" ({traj.error})" if traj.error else ""
        print(
            f"{outcome}: {args.env_id} seed {args.seed} in {traj.turns} turns, reward "
            f"{traj.reward:g}, ended by {traj.end_reason}{error}"
        )
        if args.gif:
            frames = replay(args.env_id, args.seed, traj.actions, options).frames
            print(f"wrote {write_gif(frames, args.gif)}")
        return _after_episodes("play", served, [traj], play_advice)

    return run
