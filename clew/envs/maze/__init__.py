"""The visual maze (``maze_2d``) and its registered ids.

``easy`` and ``hard`` follow VisGym (9x9 and 11x11 grids counting the wall ring, turn
budgets 20 and 30). ``small`` (7x7) and ``tiny`` (5x5) are clew's own sizes; ``room`` (7x7, no inner walls,
start and goal anywhere inside) is the CPU main job's task: the visual navigation skill
without path planning, which a 1.5M-parameter policy can learn on two cores in minutes.

Every id is registered with the BFS solver as its expert (``expert.MazeExpert``) and with
the maze's dataset hooks (``dataset.MAZE_DATASET``: the train/eval split by layout digest,
path-length statistics).
"""

from clew.envs.base import register
from clew.envs.maze.dataset import MAZE_DATASET
from clew.envs.maze.env import MAZE_OPTIONS, MazeEnv
from clew.envs.maze.expert import MazeExpert

MAZE_IDS: dict[str, dict] = {
    "maze_2d/easy": {"grid_size": 9, "max_turns": 20},
    "maze_2d/hard": {"grid_size": 11, "max_turns": 30},
    "maze_2d/small": {"grid_size": 7, "max_turns": 16},
    "maze_2d/tiny": {"grid_size": 5, "max_turns": 10},
    "maze_2d/room": {"grid_size": 7, "max_turns": 12, "layout": "room", "success_on_reach": True},
}

for _env_id, _defaults in MAZE_IDS.items():
    register(
        _env_id,
        MazeEnv,
        defaults=_defaults,
        accepted_options=MAZE_OPTIONS,
        expert=MazeExpert(),
        dataset=MAZE_DATASET,
        description=(
            f"{_defaults['grid_size']}x{_defaults['grid_size']} visual "
            f"{'open room' if _defaults.get('layout') == 'room' else 'maze'} (wall ring included), "
            f"{_defaults['max_turns']} turns"
        ),
    )

__all__ = ["MAZE_IDS", "MazeEnv", "MazeExpert"]
