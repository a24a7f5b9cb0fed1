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


try:
    spec("test/digits")
except EnvError:
    register("test/digits", DigitsEnv, accepted_options=set(), description="digits bandit")


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
