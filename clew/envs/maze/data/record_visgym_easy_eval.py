"""Record VisGym's ``maze_2d/easy`` mazes of seeds 0-63 into ``visgym_easy_eval.json``.

The SkyRL + VisGym walkthrough evaluates on 64 rows whose seeds are 0-63
(``examples/train/visgym/dataset.py --seed`` in NovaSky-AI/SkyRL); its env runs
``gymnasium.make("maze_2d/easy")`` then ``reset(seed=i)``. VisGym draws those mazes with
gymnasium's seeded numpy generator and Python's ``random`` (Wilson's algorithm in
``gymnasium/envs/maze_2d/maze_2d.py``), a different stream from clew's own generator, so
the layouts are recorded from VisGym's own code rather than re-derived.

This script runs outside clew, against VisGym's gymnasium fork; clew never imports it (it
needs no part of clew, and clew does not depend on VisGym). From a fresh virtualenv::

    git -C VISGYM_GIT archive HEAD gymnasium pyproject.toml setup.py | tar -x -C /tmp/visgym-src
    python -m venv /tmp/visgym-venv
    /tmp/visgym-venv/bin/pip install pygame numpy cloudpickle typing-extensions \\
        farama-notifications
    PYTHONPATH=/tmp/visgym-src /tmp/visgym-venv/bin/python \\
        clew/envs/maze/data/record_visgym_easy_eval.py \\
        --commit "$(git -C VISGYM_GIT rev-parse HEAD)" \\
        --output clew/envs/maze/data/visgym_easy_eval.json

For each seed it stores VisGym's ``maze_map`` (one string a row, ``1`` wall, ``0`` floor),
the agent's start and the target as (row, col), the moves of VisGym's own solver
(``env.solve()``, BFS; action ids 0 right, 1 up, 2 left, 3 down) and ``turns_needed``,
those moves plus the one ``stop`` that ends the episode. ``env.solve()`` itself returns
two trailing stops (``convert_path_to_toymaze2d_actions`` appends one and ``solve``
another); the episode ends at the first, so only one is counted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

ENV_ID = "maze_2d/easy"
NUM_SEEDS = 64
MOVE = "('move', "
STOP = "('stop', 'stop')"


def record_seed(env: Any, seed: int) -> dict[str, Any]:
    """One seed's maze, start, target and solver moves, read from VisGym's env."""
    env.reset(seed=seed)
    inner = env.unwrapped
    maze_map = inner.maze_map
    plan: list[str] = inner.solve()
    stop_at = plan.index(STOP)
    moves = []
    for action in plan[:stop_at]:
        if not action.startswith(MOVE):
            raise RuntimeError(f"seed {seed}: unexpected solver action {action!r}")
        moves.append(int(action[len(MOVE) : -1]))
    return {
        "seed": seed,
        "maze_map": ["".join(str(int(v)) for v in row) for row in maze_map],
        "start": [int(v) for v in inner._agent_location],
        "target": [int(v) for v in inner._target_location],
        "solver_moves": moves,
        "turns_needed": len(moves) + 1,
    }


def dump(document: dict[str, Any]) -> str:
    """``document`` as JSON with its header indented and one line per maze."""
    header = {k: v for k, v in document.items() if k != "mazes"}
    lines = json.dumps(header, indent=1)[:-2].splitlines()
    lines[-1] += ","
    lines.append(' "mazes": [')
    mazes = [json.dumps(m, separators=(", ", ": ")) for m in document["mazes"]]
    lines.append(",\n".join(f"  {m}" for m in mazes))
    lines.append(" ]\n}\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True, help="the VisGym commit the tree came from")
    parser.add_argument("--output", required=True, help="the JSON file to write")
    args = parser.parse_args(argv)

    import gymnasium
    import numpy

    if ENV_ID not in gymnasium.envs.registry:
        raise SystemExit(
            f"this gymnasium ({gymnasium.__file__}) has no {ENV_ID}: put VisGym's fork first "
            "on PYTHONPATH"
        )
    env = gymnasium.make(ENV_ID)
    mazes = [record_seed(env, seed) for seed in range(NUM_SEEDS)]
    env.close()
    document = {
        "format": "clew.visgym_easy_eval/1",
        "description": (
            "VisGym maze_2d/easy after gymnasium.make(env_id).reset(seed=i), i = 0..63: the "
            "SkyRL + VisGym walkthrough's 64 eval rows. maze_map: one string a row, '1' "
            "wall, '0' floor; start/target: (row, col); solver_moves: env.solve()'s moves "
            "(0 right, 1 up, 2 left, 3 down); turns_needed: moves + 1 stop."
        ),
        "source": {
            "repository": "https://github.com/visgym/VisGym",
            "commit": args.commit,
            "env_id": ENV_ID,
            "files": [
                "gymnasium/envs/__init__.py",
                "gymnasium/envs/maze_2d/maze_2d.py",
                "gymnasium/envs/maze_2d/maze_solver.py",
            ],
        },
        "script": "clew/envs/maze/data/record_visgym_easy_eval.py",
        "recorded": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "recorded_with": {
            "python": platform.python_version(),
            "numpy": numpy.__version__,
        },
        "mazes": mazes,
    }
    Path(args.output).write_text(dump(document))
    turns = sorted({m["turns_needed"] for m in mazes})
    print(f"wrote {len(mazes)} mazes to {args.output} (turns needed: {turns})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
