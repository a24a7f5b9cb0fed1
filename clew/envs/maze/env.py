"""The visual maze environment (VisGym's ``maze_2d``, re-implemented with numpy and Pillow).

Each turn the agent sees the maze image and a short text, and answers with one action.
A move into a wall or an unreadable reply leaves the state unchanged, uses a turn and is
explained in the next text. The episode ends on ``stop`` or when ``max_turns`` are used;
the reward is 1.0 for stopping on the goal (VisGym's rule), or, with
``success_on_reach=True``, for reaching it.

The samples of a GRPO group reset to one seed: a seed's maze, its distances to the goal and
its background frame are made once (``_seeded_maze``, the last ``MAZES_KEPT``), read only,
and shared by the episodes that reset to it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from clew.envs.base import Observation
from clew.envs.maze.actions import ACTION_FORMATS, Action, format_action, format_help
from clew.envs.maze.formats import maze_format
from clew.envs.maze.generate import (
    DIRECTION_NAMES,
    DIRECTIONS,
    LAYOUTS,
    Cell,
    Maze,
    check_size,
    generate_layout,
)
from clew.envs.maze.render import render_background, stamp_agent
from clew.envs.maze.replies import Invalid, read_reply
from clew.envs.maze.solver import distances_to
from clew.envs.prompt_format import encode_frame
from clew.errors import EnvError

MAZE_OPTIONS = frozenset(
    {
        "grid_size",
        "cell_px",
        "border_px",
        "max_turns",
        "action_format",
        "success_on_reach",
        "layout",
        "start_anywhere",
        "prompt_format",
    }
)


def success_sentence(success_on_reach: bool) -> str:
    return (
        "You succeed the moment you reach the red square."
        if success_on_reach
        else "You succeed only if you stop while standing on the red square."
    )


def task_prompt(grid_size: int, max_turns: int, action_format: str, success_on_reach: bool) -> str:
    """clew's own first message of an episode: the task, the action format and the turn
    budget (the ``clew`` prompt format)."""
    return (
        f"You are in a {grid_size}x{grid_size} maze seen from above. Gray cells are walls and "
        "white cells are open floor. You are the blue circle; the goal is the red square. "
        f"Each turn, make one move. {format_help(action_format)} "
        f"{success_sentence(success_on_reach)} "
        f"You have {max_turns} turns in all, and stopping uses one."
    )


# Mazes kept by _seeded_maze: far more than the groups a batch resets together.
MAZES_KEPT = 512


@lru_cache(maxsize=MAZES_KEPT)
def _seeded_maze(
    layout: str, size: int, seed: int, cell_px: int, border_px: int
) -> tuple[Maze, np.ndarray, np.ndarray]:
    """The maze of ``seed``, each cell's moves to its goal and its frame without the agent,
    read only (shared by every env that resets to the seed)."""
    maze = generate_layout(layout, size, seed)
    dist = distances_to(maze, maze.goal)
    background = render_background(maze, cell_px, border_px)
    for array in (maze.walls, dist, background):
        array.setflags(write=False)
    return maze, dist, background


class MazeEnv:
    """One maze episode at a time; ``reset(seed)`` draws the maze for that seed."""

    def __init__(
        self,
        grid_size: int = 9,
        cell_px: int = 25,
        max_turns: int = 20,
        action_format: str = "tuple",
        success_on_reach: bool = False,
        layout: str = "maze",
        border_px: int = 0,
        start_anywhere: float = 0.0,
        prompt_format: str | dict[str, Any] | None = None,
    ) -> None:
        try:
            check_size(grid_size)
        except ValueError as exc:
            raise EnvError(f"option grid_size: {exc}") from None
        if not isinstance(cell_px, int) or isinstance(cell_px, bool) or cell_px < 4:
            raise EnvError(f"option cell_px must be an integer >= 4, got {cell_px!r}")
        if not isinstance(border_px, int) or isinstance(border_px, bool) or border_px < 0:
            raise EnvError(
                f"option border_px must be an integer >= 0 (pixels of wall around the maze), got {border_px!r}"
            )
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise EnvError(f"option max_turns must be a positive integer, got {max_turns!r}")
        if action_format not in ACTION_FORMATS:
            raise EnvError(
                f"option action_format must be one of {', '.join(ACTION_FORMATS)}, got {action_format!r}"
            )
        if not isinstance(success_on_reach, bool):
            raise EnvError(
                f"option success_on_reach must be true or false, got {success_on_reach!r}"
            )
        if (
            not isinstance(start_anywhere, int | float)
            or isinstance(start_anywhere, bool)
            or not 0.0 <= start_anywhere <= 1.0
        ):
            raise EnvError(
                "option start_anywhere must be a number in [0, 1] (the share of episodes that "
                f"start on a random open cell), got {start_anywhere!r}"
            )
        if layout not in LAYOUTS:
            raise EnvError(f"option layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.layout = layout
        self.grid_size = grid_size
        self.cell_px = cell_px
        self.border_px = border_px
        self.max_turns = max_turns
        self.action_format = action_format
        self.success_on_reach = success_on_reach
        self.start_anywhere = float(start_anywhere)
        self.format = maze_format(prompt_format, action_format)
        self.prompt = self.format.task_prompt.format(
            env_prompt=task_prompt(grid_size, max_turns, action_format, success_on_reach),
            grid_size=grid_size,
            max_turns=max_turns,
            action_help=format_help(action_format),
            success=success_sentence(success_on_reach),
        )
        self.maze: Maze | None = None
        self.agent: Cell = (0, 0)
        self.start: Cell = (0, 0)  # where this episode began
        self.seed = 0  # the maze's, from reset
        self.turn = 0
        self.done = True
        self._background: np.ndarray | None = None
        self._dist: np.ndarray | None = None

    def reset(self, seed: int, start: Cell | None = None) -> Observation:
        """The maze of ``seed`` with the agent on its start, or on ``start`` (an open cell;
        SFT demonstrations from anywhere use it).

        With ``start_anywhere`` > 0 (a training option: episodes then also begin off the usual
        walk, e.g. inside a side branch, where a policy must read where it is and which way
        to go from the frame rather than from its moves since the maze's start) that share of
        seeds start on a random open cell other than the goal from which the goal is
        reachable within the budget; the draw depends on the seed alone, so every sample of
        a GRPO group starts on the same cell."""
        self.maze, self._dist, self._background = _seeded_maze(
            self.layout, self.grid_size, int(seed), self.cell_px, self.border_px
        )
        if start is not None and not self.maze.is_open(tuple(start)):
            raise EnvError(f"start {tuple(start)} is not an open cell of maze {seed}")
        if start is None and self.start_anywhere > 0:
            start = self._anywhere(int(seed))
        self.agent = self.maze.start if start is None else tuple(start)
        self.start = self.agent
        self.seed = int(seed)
        self.turn = 0
        self.done = False
        text = self.format.first_turn.format(task=self.prompt, **self._turn_fields())
        return self._observation(text)

    def _observation(self, text: str) -> Observation:
        frame = encode_frame(self.render(), self.format.image_codec)
        # The frame is the seed's maze with the agent stamped on its cell: the two name it.
        state = f"{self.seed}:{self.agent[0]},{self.agent[1]}"
        return Observation([frame], text, self.format.text_first, self.format.system_prompt, state)

    def _turn_fields(self) -> dict[str, Any]:
        remaining = self.max_turns - self.turn
        return {
            "step": self.turn + 1,
            "turn": self.turn,
            "steps_left": remaining - 1,
            "remaining": remaining,
            "max_turns": self.max_turns,
            "turns_left": ("The episode is over." if self.done else f"{remaining} turns remain."),
        }

    def start_cells(self) -> list[Cell]:
        """Open cells other than the goal from which the goal fits the turn budget, row-major
        (after ``reset``): where an episode may start under ``start_anywhere`` and where SFT
        demonstrations from anywhere start."""
        assert self._dist is not None
        stop_cost = 0 if self.success_on_reach else 1
        rows, cols = np.nonzero((self._dist > 0) & (self._dist + stop_cost <= self.max_turns))
        return [(int(r), int(c)) for r, c in zip(rows, cols, strict=True)]

    def distances(self) -> np.ndarray:
        """Moves from every cell to this maze's goal, -1 on walls (after ``reset``)."""
        assert self._dist is not None, "call reset() first"
        return self._dist

    def action_names(self) -> dict[str, str]:
        """``{"right": reply, "up": ..., "left": ..., "down": ..., "stop": ...}`` in this env's
        action format."""
        actions = [Action("move", d) for d in range(len(DIRECTIONS))] + [Action("stop")]
        names = [*DIRECTION_NAMES, "stop"]
        return {
            n: format_action(a, self.action_format) for n, a in zip(names, actions, strict=True)
        }

    def _anywhere(self, seed: int) -> Cell | None:
        """The random start of ``seed`` under ``start_anywhere``, or None (the maze's own)."""
        rng = np.random.default_rng([seed, 0x57A27])  # apart from the layout's own draw
        if rng.random() >= self.start_anywhere:
            return None
        cells = self.start_cells()
        return cells[int(rng.integers(len(cells)))] if cells else None

    def render(self):
        """The current state as a PIL image."""
        from PIL import Image

        assert self._background is not None, "call reset() first"
        return Image.fromarray(
            stamp_agent(self._background, self.agent, self.cell_px, self.border_px)
        )

    def frame(self) -> np.ndarray:
        """The current state as an HxWx3 uint8 array (no PIL object)."""
        assert self._background is not None, "call reset() first"
        return stamp_agent(self._background, self.agent, self.cell_px, self.border_px)

    def step(self, action_text: str) -> tuple[Observation, float, bool, dict[str, Any]]:
        if self.done or self.maze is None:
            raise RuntimeError("step() called on a finished episode; call reset(seed) first")
        self.turn += 1
        parsed = read_reply(action_text, self.format.reply_parser, self.action_format)
        reward, event, note = 0.0, "", ""
        fields: dict[str, Any] = {}
        if isinstance(parsed, Action) and parsed.kind == "stop":
            self.done = True
            on_goal = self.agent == self.maze.goal
            reward = 1.0 if on_goal else 0.0
            event = "stop"
            note = "you stopped on the goal: solved" if on_goal else "you stopped off the goal"
        elif isinstance(parsed, Action):
            dr, dc = DIRECTIONS[parsed.direction or 0]
            target = (self.agent[0] + dr, self.agent[1] + dc)
            name = DIRECTION_NAMES[parsed.direction or 0]
            fields["direction"] = name
            if self.maze.is_open(target):
                self.agent = target
                event, note = "moved", f"moved {name}"
                if self.success_on_reach and self.agent == self.maze.goal:
                    self.done, reward, event = True, 1.0, "reached"
                    note += " onto the goal: solved"
            else:
                event, note = "wall", f"hit a wall moving {name}; you did not move"
        else:
            event = "invalid" if isinstance(parsed, Invalid) else "parse_error"
            note = f"{parsed.reason}; you did not move"
            fields["reason"] = parsed.reason
        remaining = self.max_turns - self.turn
        if not self.done and remaining <= 0:
            self.done = True
        info = self._info(event, remaining, reward)
        info["note"] = note
        feedback = self.format.feedback.get(event, "{note}").format(note=note, **fields)
        text = self.format.later_turn.format(
            feedback=feedback, task=self.prompt, **self._turn_fields()
        )
        return self._observation(text), reward, self.done, info

    def _info(self, event: str, remaining: int, reward: float) -> dict[str, Any]:
        assert self.maze is not None and self._dist is not None
        dist = int(self._dist[self.agent])
        needed = dist if self.success_on_reach else dist + 1
        if event == "stop":
            end = "stop"
        elif event == "reached":
            end = "reached_goal"
        elif self.done:
            end = "max_turns"
        else:
            end = None
        return {
            "agent": self.agent,
            "goal": self.maze.goal,
            "event": event,
            "parse_error": event in ("parse_error", "invalid"),
            "turns_used": self.turn,
            "turns_remaining": remaining,
            "shortest_path_length": dist,
            "solvable_in_remaining": (not self.done) and needed <= remaining,
            "success": reward > 0,
            "done_reason": end,
        }

    def optimal_path_length(self) -> int:
        """Moves on the shortest path from this episode's start (after ``reset``)."""
        assert self.maze is not None and self._dist is not None
        return int(self._dist[self.start])

    def turns_needed(self) -> int:
        """Turns the optimal play uses from the start: the moves, plus the stop when required."""
        return self.optimal_path_length() + (0 if self.success_on_reach else 1)
