"""Expert demonstrations: episodes played by the env's expert, as SFT's training sequences.

Any env registered with an expert (``clew.envs.Expert``) can be imitated: each turn the
expert names the state's best replies and one of them is played, drawn at random where
several are optimal (a fixed tie-break makes long runs of one action, and a policy
imitating them learns to repeat its last move instead of reading the picture).

Demonstrations are played in the real env and tokenized through ``ChatFormat`` exactly as
the rollout engine builds an episode (first turn ``first=True``, later turns after a reply
that ended with ``<|im_end|>``), so SFT trains on the very sequences the policy will later
extend. With ``detour_prob`` > 0 some turns take one of the expert's detours on purpose
(``DetourExpert.detour_actions``: for the maze an open cell off the shortest path, or a
bump into a wall) and the expert recovers from there, as VisGym pads its demonstrations:
the policy then sees states off the optimal path and how to come back from them. Detour
replies are in the context but out of the loss by default (``train_on_detours``), so the
policy learns to recover without learning to stray. With ``start_anywhere`` > 0 that share
of demonstrations starts on a random start the env offers (``StartsAnywhere.start_cells``:
for the maze, an open cell the budget still reaches the goal from) instead of the seed's
own: the expert's move from every part of the task.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clew.data.rows import Row
from clew.envs import DetourExpert, Expert, StartsAnywhere, expert_for, make
from clew.errors import ConfigError
from clew.models.chat import ChatFormat
from clew.train.model_batch import Sample


@dataclass
class Demonstration(Sample):
    """One expert episode as a training sequence, with what was played."""

    actions: list[str] = field(default_factory=list)
    # 0-based turns out of the expert's path: detours, and a DAgger branch's policy turns
    detour_turns: list[int] = field(default_factory=list)
    reward: float = 0.0
    row_seed: int = 0
    # Where each observation chunk begins, and the image window the policy will run with
    # (generator.keep_last_k_images): the batch hides older images exactly as the engine does.
    chunk_starts: list[int] = field(default_factory=list)
    image_window: int | None = None


def _next_action(
    env: Any, expert: Expert, rng: random.Random, detour_prob: float
) -> tuple[str | None, bool]:
    """The expert's reply, or with probability ``detour_prob`` an affordable wrong one;
    None where the expert has no reply."""
    best = expert.best_actions(env)
    if not best:
        return None, False
    choice = rng.choice(best)
    if detour_prob <= 0 or rng.random() >= detour_prob:
        return choice, False
    detours = expert.detour_actions(env) if isinstance(expert, DetourExpert) else []
    if not detours:
        return choice, False
    return rng.choice(detours), True


def _check_extras(env_id: str, env: Any, expert: Expert, detour: float, anywhere: float) -> None:
    if detour > 0 and not isinstance(expert, DetourExpert):
        raise ConfigError(
            f"detour_prob={detour} needs an expert that offers detours (detour_actions); the "
            f"expert of {env_id} does not: set it to 0"
        )
    if anywhere > 0 and not isinstance(env, StartsAnywhere):
        raise ConfigError(
            f"start_anywhere={anywhere} needs an env that offers starts (start_cells); "
            f"{env_id} does not: set it to 0"
        )


def play_demonstration(
    row: Row,
    chat: ChatFormat,
    rng: random.Random,
    detour_prob: float = 0.0,
    train_on_detours: bool = False,
    start_anywhere: float = 0.0,
    prefix: Sequence[str] = (),
) -> Demonstration | None:
    """Play ``row`` with its env's expert; None if the expert's play does not fit the turn
    budget (or it has no reply on the way).

    ``prefix``: replies played first, as given and out of the loss (the policy's own turns
    of a DAgger branch, ``clew.trainer.dagger``); the expert plays on from where they lead.
    """
    expert = expert_for(row.env_id)
    env = make(row.env_id, **row.options())
    obs = env.reset(int(row.seed))
    _check_extras(row.env_id, env, expert, detour_prob, start_anywhere)
    needed = expert.turns_to_finish(env)
    if needed is None or needed > env.max_turns:
        return None
    if start_anywhere > 0 and not prefix and rng.random() < start_anywhere:
        obs = env.reset(int(row.seed), start=rng.choice(env.start_cells()))
    demo = Demonstration([], [], [], row_seed=int(row.seed))
    turn = 0
    while True:
        chunk = chat.observation_turn(obs, first=turn == 0, after_reply_end=True, pixels=False)
        demo.chunk_starts.append(len(demo.token_ids))
        demo.token_ids += chunk.token_ids
        demo.loss_mask += [0] * len(chunk.token_ids)
        demo.images += obs.images
        if turn < len(prefix):
            text, detour = prefix[turn], True
        else:
            chosen, detour = _next_action(env, expert, rng, detour_prob)
            if chosen is None:
                return None
            text = chosen
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
    rows: Sequence[Row],
    chat: ChatFormat,
    detour_prob: float = 0.0,
    seed: int = 0,
    train_on_detours: bool = False,
    start_anywhere: float = 0.0,
) -> list[Demonstration]:
    """Expert episodes for ``rows`` (rows whose expert play exceeds max_turns are skipped).

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
