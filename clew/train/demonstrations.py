"""Solver demonstrations: maze episodes played by the BFS solver, as SFT's training sequences.

Demonstrations are played in the real env and tokenized through ``ChatFormat`` exactly as
the rollout engine builds an episode (first turn ``first=True``, later turns after a reply
that ended with ``<|im_end|>``), so SFT trains on the very sequences the policy will later
extend. With ``detour_prob`` > 0 some turns take a wrong move on purpose (an open cell off
the shortest path, or a bump into a wall) and the solver recovers from there, as VisGym
pads its demonstrations: the policy then sees states off the optimal path and how to come
back from them. Detour replies are in the context but out of the loss by default
(``train_on_detours``), so the policy learns to recover without learning to stray. With
``start_anywhere`` > 0 that share of demonstrations starts on a random open cell (one
the budget still reaches the goal from) instead of the maze's start: the solver's move from
every part of the maze, as the planning probes learn it (BENCHMARKS.md, "Tenth attempt").
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clew.data.rows import MazeRow
from clew.envs import make
from clew.envs.maze.actions import Action, format_action
from clew.envs.maze.generate import DIRECTIONS
from clew.envs.maze.solver import distances_to, shortest_actions
from clew.errors import ConfigError, DataError
from clew.models.chat import ChatFormat
from clew.train.batch import Sample


@dataclass
class Demonstration(Sample):
    """One solver episode as a training sequence, with what was played."""

    actions: list[str] = field(default_factory=list)
    # 0-based turns out of the solver's path: detours, and a DAgger branch's policy turns
    detour_turns: list[int] = field(default_factory=list)
    reward: float = 0.0
    row_seed: int = 0
    # Where each observation chunk begins, and the image window the policy will run with
    # (generator.keep_last_k_images): the batch hides older images exactly as the engine does.
    chunk_starts: list[int] = field(default_factory=list)
    image_window: int | None = None


def _next_action(
    env: Any, dist: np.ndarray, rng: random.Random, detour_prob: float
) -> tuple[Action, bool]:
    """The solver's action, or with probability ``detour_prob`` an affordable wrong one."""
    maze, agent = env.maze, env.agent
    stop_cost = 0 if env.success_on_reach else 1
    if agent == maze.goal and not env.success_on_reach:
        best = Action("stop")
    else:
        # Where several moves are optimal (open rooms), pick one at random: a fixed
        # tie-break makes long runs of one action, and a policy imitating them learns to
        # repeat its last move instead of reading the picture.
        optimal = [
            d
            for d, (dr, dc) in enumerate(DIRECTIONS)
            if maze.is_open((agent[0] + dr, agent[1] + dc))
            and dist[agent[0] + dr, agent[1] + dc] == dist[agent] - 1
        ]
        best = Action(
            "move", rng.choice(optimal) if optimal else shortest_actions(maze, start=agent)[0]
        )
    if detour_prob <= 0 or rng.random() >= detour_prob:
        return best, False
    remaining = env.max_turns - env.turn
    choices = []
    for d, (dr, dc) in enumerate(DIRECTIONS):
        target = (agent[0] + dr, agent[1] + dc)
        # A detour leads away from the goal (or bumps a wall and stays): never a move that
        # is itself on a shortest path.
        if maze.is_open(target):
            if dist[target] < dist[agent]:
                continue
            needed_after = int(dist[target]) + stop_cost
        else:
            needed_after = int(dist[agent]) + stop_cost
        # The wrong turn uses one turn; the solver must still finish inside the budget.
        if remaining - 1 >= needed_after:
            choices.append(d)
    if not choices:
        return best, False
    return Action("move", rng.choice(choices)), True


def play_demonstration(
    row: MazeRow,
    chat: ChatFormat,
    rng: random.Random,
    detour_prob: float = 0.0,
    train_on_detours: bool = False,
    start_anywhere: float = 0.0,
    prefix: Sequence[str] = (),
) -> Demonstration | None:
    """Play ``row`` with the solver; None if the optimal play does not fit its turn budget.

    ``prefix``: replies played first, as given and out of the loss (the policy's own turns
    of a DAgger branch, ``clew.train.dagger``); the solver plays on from where they lead.
    """
    env = make(row.env_id, **row.options())
    obs = env.reset(int(row.seed))
    if env.turns_needed() > env.max_turns:
        return None
    dist = distances_to(env.maze, env.maze.goal)
    if start_anywhere > 0 and not prefix and rng.random() < start_anywhere:
        obs = env.reset(int(row.seed), start=rng.choice(env.start_cells()))
    demo = Demonstration([], [], [], row_seed=int(row.seed))
    turn = 0
    while True:
        chunk = chat.user_turn(
            obs.text, obs.images, first=turn == 0, after_reply_end=True, pixels=False
        )
        demo.chunk_starts.append(len(demo.token_ids))
        demo.token_ids += chunk.token_ids
        demo.loss_mask += [0] * len(chunk.token_ids)
        demo.images += obs.images
        if turn < len(prefix):
            text, detour = prefix[turn], True
        else:
            action, detour = _next_action(env, dist, rng, detour_prob)
            text = format_action(action, env.action_format)
        reply = chat.reply_tokens(text)
        demo.token_ids += reply
        in_loss = not detour or (train_on_detours and turn >= len(prefix))
        demo.loss_mask += [int(in_loss)] * len(reply)
        demo.actions.append(text)
        if detour:
            demo.detour_turns.append(turn)
        obs, reward, done, _ = env.step(text)
        demo.reward = float(reward)
        turn += 1
        if done:
            return demo


def demonstrations(
    rows: Sequence[MazeRow],
    chat: ChatFormat,
    detour_prob: float = 0.0,
    seed: int = 0,
    train_on_detours: bool = False,
    start_anywhere: float = 0.0,
) -> list[Demonstration]:
    """Solver episodes for ``rows`` (rows whose optimal play exceeds max_turns are skipped).

    Each row's detours and start depend only on ``seed`` and the row's seed, not on the
    row order.
    """
    check_shares(detour_prob, start_anywhere)
    out = []
    for row in rows:
        rng = random.Random(seed * 1_000_003 + int(row.seed))
        demo = play_demonstration(row, chat, rng, detour_prob, train_on_detours, start_anywhere)
        if demo is not None:
            out.append(demo)
    return out


def check_shares(detour_prob: float, start_anywhere: float) -> None:
    """Reject a detour or start-anywhere share outside [0, 1]."""
    for name, value in (("detour_prob", detour_prob), ("start_anywhere", start_anywhere)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name} is a share in [0, 1], got {value}")


def demonstration_batches(
    rows: Sequence[MazeRow],
    chat: ChatFormat,
    batch_size: int,
    detour_prob: float = 0.0,
    seed: int = 0,
    image_window: int | None = None,
    start_anywhere: float = 0.0,
) -> Iterator[list[Demonstration]]:
    """Endless batches of ``batch_size`` demonstrations of ``rows``, played when asked for.

    Rows are drawn without replacement, reshuffled each pass (``random.Random(seed)``).
    Pass ``p`` (from 1) plays its detours and starts with seed ``seed + p - 1``, so each
    pass sees new ones; without either every pass replays the first pass's episodes. A batch is
    exactly what ``demonstrations(rows, chat, detour_prob, pass seed, start_anywhere=...)``
    holds for its rows,
    but only one batch lives in memory at a time: a whole dataset of played episodes
    (every frame as an image) would not fit for large datasets. A row whose optimal play
    does not fit its turn budget is skipped.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    if not rows:
        raise DataError("no rows to play demonstrations of")
    check_shares(detour_prob, start_anywhere)
    return _batches(list(rows), chat, batch_size, detour_prob, seed, image_window, start_anywhere)


def _batches(
    rows: list[MazeRow],
    chat: ChatFormat,
    batch_size: int,
    detour_prob: float,
    seed: int,
    image_window: int | None,
    start_anywhere: float,
) -> Iterator[list[Demonstration]]:
    rng = random.Random(seed)
    queue: list[MazeRow] = []
    passes = played = 0
    while True:
        batch: list[Demonstration] = []
        while len(batch) < batch_size:
            if not queue:
                if passes and not played:
                    raise DataError(
                        "no training row can be solved within its turn budget; nothing to imitate"
                    )
                queue = list(rows)
                rng.shuffle(queue)
                passes += 1
                played = 0
            pass_seed = seed + passes - 1 if detour_prob > 0 or start_anywhere > 0 else seed
            row = [queue.pop()]
            for demo in demonstrations(
                row, chat, detour_prob, pass_seed, start_anywhere=start_anywhere
            ):
                demo.image_window = image_window
                batch.append(demo)
                played += 1
        yield batch
