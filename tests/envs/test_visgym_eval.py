"""VisGym's 64 recorded maze_2d/easy eval mazes: the data file, the layout that plays them,
the dataset rows of exactly those, and the turn-budget ceilings."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest

from clew.cli import main
from clew.data.rows import generate_rows, read_rows, task_seeds
from clew.envs import make
from clew.envs.maze.generate import DIRECTIONS, LAYOUTS, generate_layout, layout_seeds
from clew.envs.maze.solver import shortest_actions
from clew.envs.maze.visgym_eval import (
    LAYOUT,
    ceiling_table,
    compare_with_clew,
    format_ceiling_table,
    parse_recorded_set,
    recorded_set,
    train_overlap,
)
from clew.envs.maze.visgym_eval import (
    main as visgym_eval_main,
)
from clew.errors import DataError, EnvError

OPTIONS = {"layout": LAYOUT}


def _document() -> dict:
    path = resources.files("clew.envs.maze").joinpath("data", "visgym_easy_eval.json")
    return json.loads(path.read_text())


def test_the_data_file_says_where_its_64_mazes_came_from():
    doc = _document()
    assert doc["source"]["repository"] == "https://github.com/visgym/VisGym"
    assert len(doc["source"]["commit"]) == 40 and doc["source"]["env_id"] == "maze_2d/easy"
    assert doc["script"] == "clew/envs/maze/data/record_visgym_easy_eval.py"
    assert doc["recorded"][:4].isdigit()
    data = recorded_set()
    assert data.seeds == range(64) and [m.seed for m in data.mazes] == list(range(64))
    assert len({m.maze.layout_key() for m in data.mazes}) == 64


def test_each_recorded_maze_is_a_perfect_9x9_maze_with_corner_start_and_goal():
    corners = {(1, 1), (1, 7), (7, 1), (7, 7)}
    for m in recorded_set().mazes:
        walls = m.maze.walls
        assert walls.shape == (9, 9) and walls[0].all() and walls[-1].all()
        assert walls[:, 0].all() and walls[:, -1].all()
        open_cells = int((~walls).sum())
        passages = int((~walls[:, :-1] & ~walls[:, 1:]).sum() + (~walls[:-1] & ~walls[1:]).sum())
        assert passages == open_cells - 1  # the open cells form a tree
        assert {m.maze.start, m.maze.goal} <= corners
        assert m.maze.start[0] != m.maze.goal[0] and m.maze.start[1] != m.maze.goal[1]


def test_clews_solver_needs_the_turns_visgyms_solver_recorded():
    for m in recorded_set().mazes:
        assert len(shortest_actions(m.maze)) + 1 == m.turns_needed
        cell = m.maze.start
        for d in m.solver_moves:
            cell = (cell[0] + DIRECTIONS[d][0], cell[1] + DIRECTIONS[d][1])
            assert m.maze.is_open(cell)
        assert cell == m.maze.goal


def test_the_layout_plays_recorded_maze_i_for_seed_i_and_pays_for_stopping_on_its_goal():
    assert LAYOUT in LAYOUTS
    env = make("maze_2d/easy", **OPTIONS, action_format="keyword", max_turns=17)
    names = ["right", "up", "left", "down"]
    for seed in (0, 31, 63):
        m = recorded_set().mazes[seed]
        env.reset(seed)
        assert np.array_equal(env.maze.walls, m.maze.walls) and env.agent == m.maze.start
        reward, done = 0.0, False
        for d in m.solver_moves:
            _, reward, done, _ = env.step(f"<action>{names[d]}</action>")
            assert not done
        _, reward, done, _ = env.step("<action>stop</action>")
        assert done and reward == 1.0


def test_other_seeds_and_sizes_of_the_layout_are_clear_errors():
    for seed in (-1, 64, 1_000_000_000):
        with pytest.raises(EnvError, match="seeds 0-63.*is not one of them"):
            generate_layout(LAYOUT, 9, seed)
    with pytest.raises(EnvError, match="grid_size must be 9, got 7"):
        generate_layout(LAYOUT, 7, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        generate_layout("visgym", 9, 0)
    assert layout_seeds(LAYOUT) == range(64) and layout_seeds("maze") is None


def test_a_malformed_data_file_is_refused_with_what_is_wrong():
    doc = _document()
    doc["mazes"][3]["seed"] = 4
    with pytest.raises(ValueError, match="maze 3 carries seed 4"):
        parse_recorded_set(doc)
    doc = _document()
    doc["mazes"][0]["turns_needed"] = 12
    with pytest.raises(ValueError, match="turns_needed"):
        parse_recorded_set(doc)
    with pytest.raises(ValueError, match="missing or malformed"):
        parse_recorded_set({"mazes": []})


def test_eval_rows_of_the_layout_are_exactly_the_64_recorded_mazes():
    rows = generate_rows("maze_2d/easy", 64, "eval", env_options={**OPTIONS, "max_turns": 15})
    assert [r.seed for r in rows] == list(range(64))
    assert all(r.split == "eval" and r.max_turns == 15 for r in rows)
    needed = [m.turns_needed for m in recorded_set().mazes]
    assert [r.turns_needed for r in rows] == needed
    assert sum(r.solvable for r in rows) == sum(n <= 15 for n in needed)
    assert task_seeds("maze_2d/easy", OPTIONS) == range(64)
    assert task_seeds("maze_2d/easy") is None


def test_asking_the_layout_for_more_rows_or_train_rows_is_a_clear_error():
    with pytest.raises(DataError, match="seeds 0-63 only.*64 are eval rows, fewer than the 65"):
        generate_rows("maze_2d/easy", 65, "eval", env_options=OPTIONS)
    with pytest.raises(DataError, match="0 are train rows"):
        generate_rows("maze_2d/easy", 8, "train", env_options=OPTIONS)


def test_clew_dataset_writes_all_64_by_default_for_the_layout(tmp_path, capsys):
    code = main(["dataset", "--env-id", "maze_2d/easy", "--split", "eval",
                 "--option", f"layout={LAYOUT}", "--option", "max_turns=15",
                 "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 0
    assert "wrote 64 eval rows" in capsys.readouterr().out
    rows = read_rows(tmp_path / "eval.parquet")
    assert [r.seed for r in rows] == list(range(64))
    assert {r.options()["layout"] for r in rows} == {LAYOUT}


def test_the_ceiling_table_counts_mazes_solvable_within_each_budget():
    needed = [m.turns_needed for m in recorded_set().mazes]
    table = ceiling_table((12, 13, 15, 17, 20))
    assert [b for b, _, _ in table] == [12, 13, 15, 17, 20]
    for budget, solvable, share in table:
        assert solvable == sum(n <= budget for n in needed)
        assert share == pytest.approx(solvable / 64)
    text = format_ceiling_table((15,))
    assert f"| 15 | {sum(n <= 15 for n in needed)} / 64 |" in text
    with pytest.raises(ValueError, match="positive"):
        ceiling_table((0,))


def test_the_table_command_prints_the_source_and_the_ceilings(capsys):
    assert visgym_eval_main(["13", "17"]) == 0
    out = capsys.readouterr().out
    assert recorded_set().source["commit"] in out
    assert "| 13 |" in out and "| 17 | 64 / 64 | 100.0% |" in out


def test_clews_own_seeds_are_other_mazes_than_visgyms():
    # Same law, another random stream: the recorded layout is needed to play VisGym's.
    assert compare_with_clew().startswith("clew's seeds 0-63: 0 have VisGym's walls")
    assert train_overlap(300) == []  # the walkthrough's 256 training rows hold none of them
