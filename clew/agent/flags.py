"""The generation flags ``clew play``, ``clew eval`` and the playground share.

``add_generation_args`` declares how replies are generated, as the training config's
``generator.*`` sets it, and ``rollout_settings`` turns those flags into the rollouts'
settings; the playground (``clew.serve.episodes``) starts from the same defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

from clew.errors import ClewError


def positive_int(text: str) -> int:
    """An argparse type: a positive integer, or an error naming what was given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


API_KEY_ENV = "CLEW_SERVE_API_KEY"


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """How replies are generated, as the training config's ``generator.*`` sets it."""
    p.add_argument(
        "--max-turns", type=positive_int, default=None, help="default: each env's budget"
    )
    p.add_argument("--max-generate-length", type=positive_int, default=64)
    p.add_argument("--max-input-length", type=positive_int, default=8192)
    p.add_argument(
        "--reply-prefix",
        default="",
        help="as generator.reply_prefix: text written before sampling each reply (a policy "
        "trained with it is evaluated with it)",
    )
    p.add_argument(
        "--reply-suffix", default="", help="as generator.reply_suffix (e.g. '</action>')"
    )
    p.add_argument(
        "--allowed-tokens",
        default=None,
        help="as generator.eval_sampling_params.allowed_tokens, comma-separated (e.g. "
        "up,down,left,right,stop after --reply-prefix '<action>'): only these tokens are "
        "generated; default: the whole vocabulary, the policy's own reply",
    )
    p.add_argument(
        "--keep-last-k-images",
        type=positive_int,
        default=None,
        help="as generator.keep_last_k_images: only the last K frames stay in the context "
        "(a policy trained so is evaluated so); default: all",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (as generator.eval_sampling_params.temperature); 0: greedy",
    )
    p.add_argument(
        "--reward-rule",
        default="task",
        help="as environment.reward_rule: 'task' (the env's reward) or 'skyrl_visgym' (the "
        "SkyRL + VisGym walkthrough's, with format credit)",
    )


def allowed_tokens(args: argparse.Namespace) -> tuple[str, ...]:
    if args.allowed_tokens is None:
        return ()
    allowed = tuple(t for t in args.allowed_tokens.split(",") if t)
    if not allowed:
        raise ClewError(
            f"--allowed-tokens {args.allowed_tokens!r} names no token: give "
            "comma-separated token texts, e.g. up,down,left,right,stop"
        )
    return allowed


def rollout_settings(args: argparse.Namespace, max_turns: int, n_samples: int = 1) -> Any:
    """The flags of ``add_generation_args`` as the rollouts' settings."""
    from clew.inference.sampling import SamplingParams
    from clew.rollout.loop import RolloutSettings

    if args.temperature < 0:
        raise ClewError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    from clew.envs.rewards import reward_rule

    reward_rule(args.reward_rule)  # an unknown name fails here, listing the rules
    return RolloutSettings(
        reward_rule=args.reward_rule,
        n_samples_per_prompt=n_samples,
        max_turns=args.max_turns or max_turns,
        max_input_length=args.max_input_length,
        sampling=SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_generate_length,
            allowed_tokens=allowed_tokens(args),
        ),
        keep_last_k_images=args.keep_last_k_images,
        reply_prefix=args.reply_prefix,
        reply_suffix=args.reply_suffix,
    )
