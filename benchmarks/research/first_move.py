"""The first move of a dead-end start, shared by ``vision_probe.py`` and ``wall_probe.py``.

A maze_2d/easy start sits in a corner with two inner neighbours; where exactly one is open
the first move is forced, and since both lie towards the goal only reading the frame tells
them apart. Not a probe of its own: ``python benchmarks/research/vision_probe.py`` and
``python benchmarks/research/wall_probe.py`` import it (each puts its own folder on
``sys.path``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from clew.data.rows import Row, generate_rows
from clew.envs import make
from clew.envs.maze.actions import Action, format_action
from clew.envs.maze.generate import DIRECTIONS, Cell, Maze
from clew.inference.runtime import limit_host_threads
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.models.pixels import Pixels, as_patches
from clew.train.model_batch import ModelBatch, Sample, collate
from clew.trainer.agreement import decision_tokens

# The keyword reply of each move, indexed by direction id, and of stop.
MOVE_WORDS = [format_action(Action("move", d), "keyword") for d in range(len(DIRECTIONS))]
REPLIES = [*MOVE_WORDS, format_action(Action("stop"), "keyword")]


def move_decision(chat: ChatFormat) -> tuple[int, dict[int, str]]:
    """Where the keyword replies first differ and the reply each token there names; exits
    where the tokenizer has no single such token."""
    decision = decision_tokens(chat, REPLIES)
    if decision is None:
        sys.exit("the keyword action format has no single decision token with this tokenizer")
    return decision


def open_for_moves(
    model_dir: str, device: str
) -> tuple[torch.nn.Module, ChatFormat, int, dict[int, str]]:
    """The policy in float32 on ``device`` (seeded, host threads capped), its chat format and
    ``move_decision``: what every first-move probe starts from."""
    limit_host_threads(torch.device(device))
    torch.manual_seed(0)
    model, processor = load_policy(model_dir, "float32", device)
    chat = ChatFormat(processor)
    return model, chat, *move_decision(chat)


@dataclass
class DeadEndStart:
    text: str  # the episode's first prompt
    frame: Image.Image
    maze: Maze
    open_move: int  # direction ids (clew.envs.maze.generate.DIRECTIONS)
    open_cell: Cell
    wall_move: int
    wall_cell: Cell


def dead_end_start(row: Row) -> DeadEndStart | None:
    """``row``'s start if exactly one of its two inner neighbours is open, else None."""
    env = make(row.env_id, **row.options())
    obs = env.reset(int(row.seed))
    maze, (r, c) = env.maze, env.maze.start
    inner = [
        (d, (r + dr, c + dc))
        for d, (dr, dc) in enumerate(DIRECTIONS)
        if 0 < r + dr < maze.size - 1 and 0 < c + dc < maze.size - 1
    ]
    if len(inner) != 2 or maze.is_open(inner[0][1]) == maze.is_open(inner[1][1]):
        return None
    (d_open, c_open), (d_wall, c_wall) = sorted(inner, key=lambda x: not maze.is_open(x[1]))
    return DeadEndStart(obs.text, obs.images[0], maze, d_open, c_open, d_wall, c_wall)


def dead_end_starts(env_id: str, n: int, split: str, options: dict[str, Any]) -> list[DeadEndStart]:
    """The dead-end starts among ``n`` rows of ``split`` (about 60% of maze_2d/easy's)."""
    rows = generate_rows(env_id, n, split, env_options=options)
    return [s for row in rows if (s := dead_end_start(row))]


def first_move_batch(
    chat: ChatFormat, offset: int, turns: list[tuple[str, Image.Image, str]], device: str
) -> tuple[ModelBatch, torch.Tensor]:
    """First turns (prompt, frame, reply) as one batch, and where each reply's word is predicted.

    ``offset`` is the reply token that names the action (``move_decision``); the mask marks
    the position whose logits predict it.
    """
    samples, at = [], []
    for text, frame, reply_text in turns:
        chunk = chat.user_turn(text, [frame], first=True, after_reply_end=True, pixels=False)
        reply = chat.reply_tokens(reply_text)
        n = len(chunk.token_ids)
        samples.append(Sample([*chunk.token_ids, *reply], [0] * n + [1] * len(reply), [frame]))
        at.append(n + offset - 1)
    batch = collate(samples, chat)
    keep = torch.zeros(batch.input_ids.shape, dtype=torch.bool, device=device)
    keep[torch.arange(len(at)), torch.tensor(at)] = True
    return batch, keep


def vision_tokens(
    model: torch.nn.Module, pixels: Pixels, grid: torch.Tensor, device: str
) -> torch.Tensor:
    """The vision tower's output (the image embeddings) of encoded images, ``[tokens, D]``."""
    out = model.model.visual(as_patches(pixels, device), grid_thw=grid.to(device))
    return out.pooler_output


def patches_of(cell: Cell, size: int, cell_px: int, border_px: int, patch: int) -> list[int]:
    """Row-major indices of the vision tokens (merge size 1) whose patch holds part of ``cell``
    in a ``size`` x ``size`` maze drawn with ``cell_px`` cells inside a ``border_px`` frame."""
    side = (size * cell_px + 2 * border_px) // patch
    span = [
        range((border_px + i * cell_px) // patch, (border_px + (i + 1) * cell_px - 1) // patch + 1)
        for i in cell
    ]
    return [r * side + c for r in span[0] for c in span[1]]
