"""Small environments for tests of the training machinery, registered on import.

``test/line`` comes with its expert, registered beside it the way any project outside
clew would register its own env: SFT, DAgger and agreement need nothing else.
"""

from __future__ import annotations

import json

from PIL import Image

from clew.data.rows import Row
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


class LineEnv:
    """Walk along a line of five cells to cell 3: reply ``right`` or ``left`` (anything else
    is unreadable and stays); reward 1 on reaching cell 3, within five turns. The frame's
    colour is the cell. Episodes may start on any cell (``start_cells``)."""

    max_turns = 5
    goal = 3
    cells = 5

    def __init__(self, **options):
        self.cell, self.turn, self.done = 0, 0, True

    def _obs(self, text):
        return Observation([Image.new("RGB", (28, 28), (50 * self.cell, 90, 0))], text)

    def reset(self, seed, start=None):
        self.cell, self.turn, self.done = (0 if start is None else int(start)), 0, False
        return self._obs("Reach cell 3: answer right or left.")

    def start_cells(self):
        return [c for c in range(self.cells) if c != self.goal]

    def action_names(self):
        return {"right": "right", "left": "left"}

    def step(self, text):
        self.turn += 1
        word = text.strip().lower()
        step = {"right": 1, "left": -1}.get(word, 0)
        self.cell = min(max(self.cell + step, 0), self.cells - 1)
        reward = float(self.cell == self.goal)
        self.done = reward > 0 or self.turn >= self.max_turns
        note = f"at cell {self.cell}" if step else f"unreadable {word!r}"
        return self._obs(note), reward, self.done, {"done_reason": "stop"}


class LineExpert:
    """``LineEnv``'s solver: step toward cell 3; its detour is the step away, where the
    turns left still reach the goal after it."""

    def best_actions(self, env):
        if env.cell == env.goal:
            return []
        return ["right" if env.cell < env.goal else "left"]

    def turns_to_finish(self, env):
        return abs(env.goal - env.cell)

    def detour_actions(self, env):
        away = "left" if env.cell < env.goal else "right"
        after = env.cell - 1 if away == "left" else env.cell + 1
        if not 0 <= after < env.cells:
            return []
        fits = env.max_turns - env.turn - 1 >= abs(env.goal - after)
        return [away] if fits else []

    def state_groups(self, env):
        return ["near" if abs(env.goal - env.cell) <= 1 else "far"]


for _name, _cls, _text, _expert in (
    ("test/digits", DigitsEnv, "digits bandit", None),
    ("test/walk", WalkEnv, "a walk on a line", None),
    ("test/line", LineEnv, "a line of five cells, with its expert", LineExpert()),
):
    try:
        spec(_name)
    except EnvError:
        register(_name, _cls, accepted_options=set(), description=_text, expert=_expert)


def walk_rows(n: int, split: str = "train") -> list[Row]:
    facts = {"turns_needed": 3, "solvable": True}
    return [Row("test/walk", json.dumps({}), seed, split, "Walk.", 3, facts) for seed in range(n)]


def digits_rows(n: int, split: str = "train") -> list[Row]:
    facts = {"turns_needed": 1, "solvable": True}
    return [
        Row("test/digits", json.dumps({}), seed, split, "Write digits.", 1, facts)
        for seed in range(n)
    ]


def on_ray_worker() -> None:
    """Ray workers' setup hook (``ray_runtime_env``): importing this module, as Ray does to
    call the hook, registers the test envs on the worker too."""


def ray_runtime_env() -> dict:
    """A Ray ``runtime_env`` whose workers know the test envs: the tests folder on their
    ``PYTHONPATH`` (beside the driver's own) and ``on_ray_worker`` as their setup hook.

    The hook lives here, at the top of the tests folder, and not in a test module: a test
    module lies in a subfolder that is not on the workers' path."""
    import os
    from pathlib import Path

    tests = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    return {
        "env_vars": {"PYTHONPATH": path},
        "worker_process_setup_hook": f"{__name__}.on_ray_worker",
    }
