"""How often the policy picks the expert's reply along the expert's own path (teacher forced).

Closed-loop pass@1 mixes reading the frame, planning and recovering from mistakes, and on
64 mazes it moves in steps of 1.6 points. Agreement with the env's expert
(``clew.envs.Expert``) on the states of its own episode needs one forward pass per row,
and where the expert names groups of states (``GroupingExpert.state_groups``) it is also
reported per group. The maze's groups are the agent's cell (corridor, junction, ...) and
its distance to the goal: a policy that agrees near the goal and guesses far from it reads
the frame but does not plan. ``clew sft`` reports it beside pass@1 at each evaluation.

A turn counts as agreeing when the policy's most likely action, given the expert's
episode so far, is one of the expert's best replies there. The action is read at the
first reply token where the replies of the env's actions (``NamedActions.action_names``)
differ, so the action format must give every action a distinct token there (the maze's
``keyword`` does: ``<action>up</action>``); for an env that does not name its actions or a
format without such a token, there is nothing to report and the result is empty.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from clew.data.rows import Row
from clew.envs import GroupingExpert, NamedActions, expert_for, make
from clew.models.chat import ChatFormat
from clew.models.logit_masks import banned_token_ids, mask_banned
from clew.models.precision import bf16_autocast
from clew.train.forward import logits_at
from clew.train.model_batch import collate
from clew.trainer.demonstrations import Demonstration, play_demonstration

__all__ = ["TurnPrediction", "decision_tokens", "solver_agreement", "solver_predictions"]

PREFIX = "eval/agreement/"


def decision_tokens(chat: ChatFormat, actions: Sequence[str]) -> tuple[int, dict[int, str]] | None:
    """Where the replies ``actions`` first differ, and the reply each token there names."""
    replies = {text: chat.reply_tokens(text) for text in actions}
    for i in range(min(len(r) for r in replies.values())):
        tokens = {text: r[i] for text, r in replies.items()}
        if len(set(tokens.values())) > 1:
            if len(set(tokens.values())) < len(tokens):
                return None  # some actions share this token: no single decision position
            return i, {t: text for text, t in tokens.items()}
    return None


def _turn_labels(
    row: Row, demo: Demonstration
) -> tuple[tuple[str, ...], list[tuple[set[str], list[str]]]]:
    """The replies of the env's actions (empty if it names none) and, per turn of ``demo``,
    the expert's best replies and the state's groups."""
    expert = expert_for(row.env_id)
    env = make(row.env_id, **row.options())
    env.reset(int(row.seed))
    actions = tuple(env.action_names().values()) if isinstance(env, NamedActions) else ()
    grouped = isinstance(expert, GroupingExpert)
    out = []
    for action in demo.actions:
        groups = ["all", *(expert.state_groups(env) if grouped else [])]
        out.append((set(expert.best_actions(env)), groups))
        env.step(action)
    return actions, out


@dataclass
class TurnPrediction:
    """One turn of an expert episode: what the policy would say, and what was optimal."""

    row: int  # index into the rows given
    turn: int
    predicted: str | None  # the reply the policy's most likely action token names
    logprob: float  # of that word (the policy's confidence in it)
    optimal: set[str]
    groups: list[str]


@torch.no_grad()
def solver_predictions(
    model: torch.nn.Module,
    chat: ChatFormat,
    rows: Sequence[Row],
    *,
    image_window: int | None = None,
    autocast: bool = False,
    batch_size: int = 16,
) -> list[TurnPrediction]:
    """Every turn of the expert's episode of each row, teacher forced (see the module
    docstring).

    Rows whose expert play exceeds their turn budget are left out, and so are rows whose
    env names no actions or whose action format has no single decision token.
    """
    decisions: dict[tuple[str, ...], tuple[int, dict[int, str]] | None] = {}
    played = []
    for index, row in enumerate(rows):
        demo = play_demonstration(row, chat, random.Random(0))
        if demo is None:
            continue
        actions, groups = _turn_labels(row, demo)
        if actions not in decisions:
            decisions[actions] = decision_tokens(chat, actions) if actions else None
        if decisions[actions] is not None:
            demo.image_window = image_window
            played.append((index, demo, groups, decisions[actions]))
    device = next(model.parameters()).device
    banned = banned_token_ids(chat).to(device)
    dtype = torch.bfloat16 if autocast else next(model.parameters()).dtype
    out: list[TurnPrediction] = []
    was_training = model.training
    model.eval()
    for start in range(0, len(played), batch_size):
        chunk = played[start : start + batch_size]
        batch = collate([demo for _, demo, _, _ in chunk], chat)
        keep = torch.zeros(batch.input_ids.shape, dtype=torch.bool, device=device)
        turns = []
        for b, (index, demo, groups_of_turns, (offset, action_of)) in enumerate(chunk):
            starts = [
                i
                for i in range(1, len(demo.loss_mask))
                if demo.loss_mask[i] and not demo.loss_mask[i - 1]
            ]
            for turn, (reply_start, (good, groups)) in enumerate(
                zip(starts, groups_of_turns, strict=True)
            ):
                keep[b, reply_start + offset - 1] = True  # logits at t predict token t + 1
                turns.append((index, turn, action_of, good, groups))
        with bf16_autocast(device, autocast):
            logits = logits_at(model, batch, keep, dtype)  # row-major: the order of ``turns``
        logp = torch.log_softmax(mask_banned(logits.float(), banned), -1)
        words = logp.argmax(-1)
        best = logp.gather(-1, words[:, None]).squeeze(-1)
        for (index, turn, action_of, good, groups), word, lp in zip(
            turns, words.tolist(), best.tolist(), strict=True
        ):
            out.append(TurnPrediction(index, turn, action_of.get(word), lp, good, groups))
    model.train(was_training)
    return out


def solver_agreement(
    model: torch.nn.Module,
    chat: ChatFormat,
    rows: Sequence[Row],
    *,
    image_window: int | None = None,
    autocast: bool = False,
    batch_size: int = 16,
) -> dict[str, float]:
    """``eval/agreement/<group>``: the share of agreeing turns in each group.

    Groups: ``all``, and those the expert names (``GroupingExpert``; the maze's: the
    agent's cell, ``corridor``, ``junction``, ``dead_end``, ``goal``, and its distance to
    the goal, ``dist_0_3``, ``dist_4_7``, ``dist_8_11``, ``dist_12_plus``).
    """
    hits: dict[str, list[int]] = defaultdict(list)
    for p in solver_predictions(
        model, chat, rows, image_window=image_window, autocast=autocast, batch_size=batch_size
    ):
        for group in p.groups:
            hits[group].append(int(p.predicted in p.optimal))
    return {PREFIX + g: sum(v) / len(v) for g, v in sorted(hits.items())}
