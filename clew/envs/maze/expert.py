"""The maze's expert: breadth-first distances to the goal label every state.

From any cell the optimal replies are the moves one step closer to the goal (all of them
where several are, as in open rooms, in VisGym's direction order), and ``stop`` on the
goal. Its detours are the moves that do not get closer (away, or into a wall) after which
the budget still reaches the goal, and it groups states by the agent's cell (dead end,
corridor, junction, goal) and by distance to the goal, where a policy that reads the frame
but does not plan agrees near the goal and guesses far from it.
"""

from __future__ import annotations

from clew.envs.maze.actions import Action, format_action
from clew.envs.maze.env import MazeEnv
from clew.envs.maze.generate import DIRECTIONS, Cell


def _neighbours(env: MazeEnv) -> list[tuple[int, Cell]]:
    r, c = env.agent
    return [(d, (r + dr, c + dc)) for d, (dr, dc) in enumerate(DIRECTIONS)]


def _stop_cost(env: MazeEnv) -> int:
    return 0 if env.success_on_reach else 1


class MazeExpert:
    """The BFS solver of ``MazeEnv`` (an ``Expert``, ``DetourExpert`` and ``GroupingExpert``)."""

    def best_actions(self, env: MazeEnv) -> list[str]:
        assert env.maze is not None, "call reset() first"
        if env.agent == env.maze.goal:
            return [format_action(Action("stop"), env.action_format)]
        dist = env.distances()
        here = dist[env.agent]
        return [
            format_action(Action("move", d), env.action_format)
            for d, cell in _neighbours(env)
            if env.maze.is_open(cell) and dist[cell] == here - 1
        ]

    def turns_to_finish(self, env: MazeEnv) -> int | None:
        here = int(env.distances()[env.agent])
        return None if here < 0 else here + _stop_cost(env)

    def detour_actions(self, env: MazeEnv) -> list[str]:
        assert env.maze is not None, "call reset() first"
        dist = env.distances()
        remaining = env.max_turns - env.turn
        out = []
        for d, cell in _neighbours(env):
            # A detour leads away from the goal (or bumps a wall and stays): never a move
            # that is itself on a shortest path.
            if env.maze.is_open(cell):
                if dist[cell] < dist[env.agent]:
                    continue
                needed_after = int(dist[cell]) + _stop_cost(env)
            else:
                needed_after = int(dist[env.agent]) + _stop_cost(env)
            # The wrong turn uses one turn; the solver must still finish inside the budget.
            if remaining - 1 >= needed_after:
                out.append(format_action(Action("move", d), env.action_format))
        return out

    def state_groups(self, env: MazeEnv) -> list[str]:
        """The agent's cell (``dead_end``, ``corridor``, ``junction``, ``goal``) and its
        distance band to the goal (``dist_0_3``, ``dist_4_7``, ``dist_8_11``,
        ``dist_12_plus``)."""
        assert env.maze is not None, "call reset() first"
        if env.agent == env.maze.goal:
            kind = "goal"
        else:
            opened = sum(env.maze.is_open(cell) for _, cell in _neighbours(env))
            kind = {1: "dead_end", 2: "corridor"}.get(opened, "junction")
        far = int(env.distances()[env.agent])
        band = "dist_12_plus" if far >= 12 else f"dist_{far // 4 * 4}_{far // 4 * 4 + 3}"
        return [kind, band]
