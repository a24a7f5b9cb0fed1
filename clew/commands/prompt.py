"""``clew prompt``: what the model sees of an episode, under a config's prompt format.

The episode is the config's env (the pipeline's dataset env where the recipe makes its own
rows, else ``environment.env_id``) at ``--seed``, played ``--turns`` turns by the env's
expert; what is printed is the conversation up to the next reply. With a model (``--model``,
else ``trainer.policy.model.path``, else ``sft.model_path``) the parts are laid out in that
model's chat tokens exactly as rollouts and SFT lay them out, decoded with their special
tokens and counted; ``--ids`` prints the token ids instead. Without one, the texts and
where the images sit.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from typing import Any

from clew.commands.registry import _env_options, command
from clew.errors import ClewError


@dataclass
class Part:
    """One turn of the conversation: a user observation or an assistant reply."""

    role: str
    turn: int
    obs: Any = None
    reply: str = ""


@command("prompt", "print what the model sees of an episode (texts, images, token counts)")
def _prompt(p: argparse.ArgumentParser) -> Any:
    p.add_argument("--config", help="YAML config file (overrides apply on top)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--seed", type=int, default=0, help="the episode's seed")
    p.add_argument("--turns", type=int, default=0, help="expert turns played before the prompt")
    p.add_argument("--env-id", help="env id (default: the config's)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help="env option (repeatable)")
    p.add_argument("--model", help="checkpoint directory whose tokenizer lays the prompt out")
    p.add_argument("--ids", action="store_true", help="print the token ids as JSON")

    def run(args: argparse.Namespace) -> int:
        from clew.config import load_config

        if args.turns < 0:
            raise ClewError(f"--turns must be >= 0, got {args.turns}")
        cfg = load_config(args.config, args.overrides)
        env_id, options = episode_env(cfg, args.env_id, _env_options(args))
        parts, env = expert_episode(env_id, options, args.seed, args.turns)
        model = args.model or cfg.trainer.policy.model.path or cfg.sft.model_path
        fmt = getattr(env, "format", None)
        played = sum(p.role == "assistant" for p in parts)
        head = f"{env_id} seed {args.seed}"
        head += f", prompt format {fmt.name}" if fmt is not None else ""
        head += f", after {played} expert turn{'s' * (played != 1)}"
        if played < args.turns:
            head += f" (the episode ended after turn {played})"
        if model is None:
            if args.ids:
                raise ClewError(
                    "--ids needs a model's tokenizer: give --model DIR or set "
                    "trainer.policy.model.path"
                )
            print(f"# {head}; no model given (--model DIR), so no token counts")
            print(render_text(parts))
            return 0
        from clew.models import load_processor
        from clew.models.chat import ChatFormat

        chat = ChatFormat(load_processor(model))
        ids, sections = layout(chat, parts)
        if args.ids:
            print(json.dumps({"input_ids": ids, "parts": sections}))
            return 0
        print(f"# {head}; model {model}")
        for s in sections:
            text = show_specials(chat.tokenizer.decode(ids[s["start"] : s["end"]]))
            label = f"{s['role']}, turn {s['turn']}: {s['end'] - s['start']} tokens"
            if s.get("image_tokens"):
                label += f" ({s['image_tokens']} of them image tokens)"
            print(f"--- {label} ---\n{text}")
        print(f"# {len(ids)} tokens in all")
        return 0

    return run


def episode_env(cfg: Any, env_id: str | None, options: dict[str, Any]) -> tuple[str, dict]:
    """The env id and options a config's episodes use, with ``options`` over them."""
    base: dict[str, Any] = {}
    if env_id is None:
        if "dataset" in cfg.pipeline.stages:
            env_id, base = cfg.pipeline.dataset.env_id, dict(cfg.pipeline.dataset.env_options)
        else:
            env_id = cfg.environment.env_id
    if cfg.environment.prompt_format is not None:
        base["prompt_format"] = cfg.environment.prompt_format
    return env_id, {**base, **options}


def expert_episode(
    env_id: str, options: dict[str, Any], seed: int, turns: int
) -> tuple[list[Part], Any]:
    """The conversation of ``turns`` expert turns at ``seed``, ending on the observation the
    next reply would answer (or on the last reply, where the episode ended before), and
    the env that played it."""
    from clew.envs import expert_for, make

    expert = expert_for(env_id)
    env = make(env_id, **options)
    obs = env.reset(seed)
    parts: list[Part] = []
    for turn in range(1, turns + 1):
        parts.append(Part("user", turn, obs=obs))
        best = expert.best_actions(env)
        if not best:
            return parts, env
        parts.append(Part("assistant", turn, reply=best[0]))
        obs, _, done, _ = env.step(best[0])
        if done:
            return parts, env
    parts.append(Part("user", turns + 1, obs=obs))
    return parts, env


def render_text(parts: list[Part]) -> str:
    """The conversation as text, images shown as ``<image WxH>`` where they sit."""
    out: list[str] = []
    system = parts[0].obs.system if parts and parts[0].obs is not None else None
    if system:
        out.append(f"--- system ---\n{system}")
    for part in parts:
        if part.role == "assistant":
            out.append(f"--- assistant, turn {part.turn} ---\n{part.reply}")
            continue
        images = "".join(f"<image {im.width}x{im.height}>" for im in part.obs.images)
        text = part.obs.text
        body = text + images if part.obs.text_first else images + text
        out.append(f"--- user, turn {part.turn} ---\n{body}")
    return "\n".join(out)


def layout(chat: Any, parts: list[Part]) -> tuple[list[int], list[dict[str, Any]]]:
    """The token ids of the conversation as rollouts lay it out, and each part's span."""
    ids: list[int] = []
    sections: list[dict[str, Any]] = []
    first = True
    for part in parts:
        start = len(ids)
        if part.role == "assistant":
            ids += chat.reply_tokens(part.reply)
            sections.append({"role": "assistant", "turn": part.turn, "start": start})
        else:
            obs = part.obs
            if first and obs.system:
                system = chat.encode_text(f"<|im_start|>system\n{obs.system}<|im_end|>\n")
                sections.append({"role": "system", "turn": 0, "start": start})
                sections[-1]["end"] = start + len(system)
                start += len(system)
            chunk = chat.observation_turn(obs, first=first)
            ids += chunk.token_ids
            grid = chunk.image_grid_thw
            image_tokens = 0 if grid is None else chat.image_token_count(grid)
            sections.append(
                {"role": "user", "turn": part.turn, "start": start, "image_tokens": image_tokens}
            )
            first = False
        sections[-1]["end"] = len(ids)
    return ids, sections


def show_specials(text: str) -> str:
    """Runs of image placeholders shortened to one with a count."""
    return re.sub(
        r"(?:<\|image_pad\|>){2,}",
        lambda m: f"<|image_pad|>x{len(m.group(0)) // len('<|image_pad|>')}",
        text,
    )
