"""Small environments for tests of the training machinery, registered on import."""

from __future__ import annotations

import json

from PIL import Image

from clew.data.rows import MazeRow
from clew.envs import register
from clew.envs.base import Observation, spec
from clew.errors import EnvError


class DigitsEnv:
    """One turn; the reward is the share of the reply's characters that are digits.

    A dense reward a random policy already earns a little of, so a few GRPO steps must
    raise it: a test of the loop's plumbing (generate, advantages, update), not of mazes.
    """

    max_turns = 1

    def __init__(self, **options):
        self.done = False

    def reset(self, seed):
        self.done = False
        return Observation([Image.new("RGB", (28, 28), (seed % 255, 0, 0))], "Write digits.")

    def step(self, text):
        self.done = True
        reward = sum(c.isdigit() for c in text) / max(len(text), 1)
        return Observation([], "done"), reward, True, {"done_reason": "stop"}


class WalkEnv:
    """Several turns on a line of four cells: a reply whose first byte is even steps right,
    any other (or none) steps left, not past cell 0; reward 1 on reaching cell 3, within six
    turns. About half of a random model's tokens step right.

    The frame's colour is the cell, so the samples of a group revisit the same states: a
    test of per-turn credit (gigpo) that a random policy already solves often.
    """

    max_turns = 6

    def __init__(self, **options):
        self.cell, self.turn, self.done = 0, 0, False

    def _obs(self, text):
        return Observation([Image.new("RGB", (28, 28), (60 * self.cell, 0, 0))], text)

    def reset(self, seed):
        self.cell, self.turn, self.done = 0, 0, False
        return self._obs("Walk right.")

    def step(self, text):
        self.turn += 1
        right = text.encode()[:1] and text.encode()[0] % 2 == 0
        self.cell = self.cell + 1 if right else max(self.cell - 1, 0)
        self.done = self.cell == 3 or self.turn >= self.max_turns
        reward = float(self.cell == 3)
        return self._obs(f"turn {self.turn}"), reward, self.done, {"done_reason": "stop"}


for _name, _cls, _text in (
    ("test/digits", DigitsEnv, "digits bandit"),
    ("test/walk", WalkEnv, "a walk on a line"),
):
    try:
        spec(_name)
    except EnvError:
        register(_name, _cls, accepted_options=set(), description=_text)


def walk_rows(n: int, split: str = "train") -> list[MazeRow]:
    return [
        MazeRow("test/walk", json.dumps({}), seed, split, "Walk.", 0, 3, 3, True, f"{split}{seed}")
        for seed in range(n)
    ]


def digits_rows(n: int, split: str = "train") -> list[MazeRow]:
    return [
        MazeRow(
            "test/digits",
            json.dumps({}),
            seed,
            split,
            "Write digits.",
            0,
            1,
            1,
            True,
            f"{split}{seed}",
        )
        for seed in range(n)
    ]
