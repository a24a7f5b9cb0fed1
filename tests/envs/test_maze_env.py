"""The visual maze: generation, solver, pixels, actions, rules."""

from __future__ import annotations

import subprocess
import sys
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clew.envs import list_envs, make
from clew.envs.maze.actions import Action, ParseFailure, format_action, parse_action
from clew.envs.maze.generate import DIRECTIONS, generate_maze
from clew.envs.maze.render import AGENT_RGB, FLOOR_RGB, GOAL_RGB, WALL_RGB
from clew.envs.maze.solver import shortest_actions
from clew.errors import EnvError


def _open_cells(walls: np.ndarray) -> list[tuple[int, int]]:
    return [tuple(map(int, rc)) for rc in np.argwhere(~walls)]


def _independent_shortest(walls: np.ndarray, a, b) -> int:
    """Plain BFS written apart from the solver, over the open-cell graph."""
    seen = {a: 0}
    queue = deque([a])
    while queue:
        cell = queue.popleft()
        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            n = (cell[0] + dr, cell[1] + dc)
            if not walls[n] and n not in seen:
                seen[n] = seen[cell] + 1
                queue.append(n)
    return seen[b]


@pytest.mark.parametrize("size", [5, 7, 9, 11, 13])
def test_every_maze_is_perfect_with_start_and_goal_on_opposite_corners(size):
    for seed in range(40):
        maze = generate_maze(size, seed)
        walls = maze.walls
        assert walls[0].all() and walls[-1].all() and walls[:, 0].all() and walls[:, -1].all()
        cells = _open_cells(walls)
        edges = sum(1 for r, c in cells for dr, dc in ((0, 1), (1, 0)) if not walls[r + dr, c + dc])
        # A connected graph with |V| - 1 edges is a tree: exactly one path between cells.
        assert edges == len(cells) - 1
        reached = {maze.start}
        queue = deque([maze.start])
        while queue:
            r, c = queue.popleft()
            for dr, dc in DIRECTIONS:
                n = (r + dr, c + dc)
                if not walls[n] and n not in reached:
                    reached.add(n)
                    queue.append(n)
        assert reached == set(cells)
        lo, hi = 1, size - 2
        assert {maze.start, maze.goal} in ({(lo, lo), (hi, hi)}, {(lo, hi), (hi, lo)})


def test_wilson_covers_many_layouts_and_all_corner_pairs():
    mazes = [generate_maze(9, s) for s in range(200)]
    assert len({m.layout_key() for m in mazes}) == 200
    assert len({(m.start, m.goal) for m in mazes}) == 4


def test_same_seed_gives_same_maze_and_pixels_in_another_process():
    env = make("maze_2d/easy")
    obs = env.reset(1234)
    digest = np.asarray(obs.images[0]).tobytes().hex()[:4000]
    code = (
        "import numpy as np; from clew.envs import make; e = make('maze_2d/easy'); "
        "o = e.reset(1234); print(np.asarray(o.images[0]).tobytes().hex()[:4000]); "
        "print(e.maze.layout_key())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    other_pixels, other_key = out.stdout.split()
    assert other_pixels == digest
    assert other_key == env.maze.layout_key()


@pytest.mark.parametrize("size", [5, 9, 11])
def test_solver_path_is_shortest_and_reaches_the_goal(size):
    for seed in range(30):
        maze = generate_maze(size, seed)
        actions = shortest_actions(maze)
        assert len(actions) == _independent_shortest(maze.walls, maze.start, maze.goal)
        cell = maze.start
        for a in actions:
            dr, dc = DIRECTIONS[a]
            cell = (cell[0] + dr, cell[1] + dc)
            assert not maze.walls[cell]
        assert cell == maze.goal


def test_rendered_pixels_follow_the_spec():
    env = make("maze_2d/easy")
    env.reset(7)
    img = np.asarray(env.render())
    assert img.shape == (225, 225, 3) and img.dtype == np.uint8
    maze, px = env.maze, 25
    for r in range(9):
        for c in range(9):
            block = img[r * px : (r + 1) * px, c * px : (c + 1) * px].reshape(-1, 3)
            colours = {tuple(map(int, x)) for x in block}
            if (r, c) == env.agent:
                assert AGENT_RGB in colours and len(colours) == 2
            elif (r, c) == maze.goal:
                assert colours == {GOAL_RGB}
            elif maze.walls[r, c]:
                assert colours == {WALL_RGB}
            else:
                assert colours == {FLOOR_RGB}
    r, c = env.agent
    block = img[r * px : (r + 1) * px, c * px : (c + 1) * px]
    blue = np.all(block == AGENT_RGB, axis=-1)
    # A disc of radius 6.25 px centred in the cell: area about pi * 6.25^2 = 123 px.
    assert 110 <= blue.sum() <= 135
    ys, xs = np.nonzero(blue)
    assert abs(ys.mean() - 12) < 0.6 and abs(xs.mean() - 12) < 0.6
    assert ys.max() - ys.min() + 1 in (12, 13) and xs.max() - xs.min() + 1 in (12, 13)


def test_cell_size_option_scales_the_image():
    env = make("maze_2d/tiny", cell_px=28)
    assert env.reset(0).images[0].size == (140, 140)


def test_border_option_frames_the_same_maze_in_wall_gray():
    plain, framed = make("maze_2d/easy", cell_px=14), make("maze_2d/easy", cell_px=14, border_px=7)
    a, b = np.asarray(plain.reset(3).images[0]), np.asarray(framed.reset(3).images[0])
    assert b.shape == (140, 140, 3)
    assert np.array_equal(b[7:-7, 7:-7], a)  # the agent and maze sit shifted by the border
    ring = np.concatenate([b[:7].reshape(-1, 3), b[-7:].reshape(-1, 3), b[:, :7].reshape(-1, 3)])
    assert {tuple(map(int, x)) for x in ring} == {WALL_RGB}
    step = framed.step(format_action(Action("move", 0), "tuple"))[0].images[0]
    moved = np.asarray(plain.step(format_action(Action("move", 0), "tuple"))[0].images[0])
    assert np.array_equal(np.asarray(step)[7:-7, 7:-7], moved)
    with pytest.raises(EnvError, match="border_px must be an integer >= 0"):
        make("maze_2d/easy", border_px=-1)


def _play(env, seed, words):
    env.reset(seed)
    results = []
    for w in words:
        action = (
            Action("stop")
            if w == "stop"
            else Action("move", ("right", "up", "left", "down").index(w))
        )
        results.append(env.step(format_action(action, env.action_format)))
    return results


def _solution_words(env, seed):
    env.reset(seed)
    return [("right", "up", "left", "down")[a] for a in shortest_actions(env.maze)]


@pytest.mark.parametrize("fmt", ["tuple", "keyword"])
def test_both_action_formats_solve_the_maze_with_reward_one(fmt):
    env = make("maze_2d/easy", action_format=fmt)
    seed = next(s for s in range(100) if len(_solution_words(env, s)) <= 18)
    results = _play(env, seed, [*_solution_words(env, seed), "stop"])
    obs, reward, done, info = results[-1]
    assert done and reward == 1.0 and info["success"] and info["done_reason"] == "stop"
    assert all(r[1] == 0.0 and not r[2] for r in results[:-1])
    assert ("<action>" in env.prompt) == (fmt == "keyword")


def test_stopping_off_the_goal_gives_zero():
    env = make("maze_2d/easy")
    env.reset(0)
    obs, reward, done, info = env.step("('stop', 'stop')")
    assert done and reward == 0.0 and not info["success"]


def test_wall_move_keeps_state_uses_a_turn_and_says_why():
    env = make("maze_2d/easy", action_format="keyword")
    env.reset(3)
    r, c = env.agent
    wall_dir = next(d for d, (dr, dc) in enumerate(DIRECTIONS) if env.maze.walls[r + dr, c + dc])
    before = np.asarray(env.render()).copy()
    obs, reward, done, info = env.step(format_action(Action("move", wall_dir), "keyword"))
    assert env.agent == (r, c) and info["event"] == "wall" and info["turns_used"] == 1
    assert "hit a wall" in obs.text and "19 turns remain" in obs.text
    assert np.array_equal(np.asarray(obs.images[0]), before)


def test_unparseable_reply_uses_a_turn_and_says_why():
    env = make("maze_2d/easy")
    env.reset(3)
    start = env.agent
    obs, reward, done, info = env.step("I think I will go north")
    assert info["parse_error"] and env.agent == start and not done
    assert "could not parse" in obs.text and "19 turns remain" in obs.text


def test_turn_budget_ends_the_episode():
    env = make("maze_2d/easy", max_turns=3)
    env.reset(3)
    outs = [env.step("nonsense") for _ in range(3)]
    assert [o[2] for o in outs] == [False, False, True]
    assert outs[-1][3]["done_reason"] == "max_turns" and outs[-1][1] == 0.0
    with pytest.raises(RuntimeError):
        env.step("nonsense")


def test_success_on_reach_ends_at_the_goal_without_stop():
    env = make("maze_2d/easy", success_on_reach=True)
    seed = next(s for s in range(100) if len(_solution_words(env, s)) <= 20)
    results = _play(env, seed, _solution_words(env, seed))
    obs, reward, done, info = results[-1]
    assert done and reward == 1.0 and info["done_reason"] == "reached_goal"


def test_info_tracks_distance_and_solvability():
    env = make("maze_2d/easy")
    env.reset(11)
    words = _solution_words(env, 11)
    _, _, _, info = _play(env, 11, words[:1])[0]
    assert info["shortest_path_length"] == len(words) - 1
    assert info["solvable_in_remaining"] == (len(words) - 1 + 1 <= 19)
    assert info["goal"] == env.maze.goal and info["agent"] == env.agent


def test_last_well_formed_action_counts():
    assert parse_action("('move', 0) then ('move', 3)", "tuple") == Action("move", 3)
    assert parse_action("('move', 2) ('move', 9)", "tuple") == Action("move", 2)
    assert parse_action('("stop", "stop")', "tuple") == Action("stop")
    assert parse_action("<action>up</action> no, <action>LEFT</action>", "keyword") == Action(
        "move", 2
    )
    assert isinstance(parse_action("<action>up</action>", "tuple"), ParseFailure)
    assert isinstance(parse_action("('move', 0)", "keyword"), ParseFailure)


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(st.text(), st.binary().map(lambda b: b.decode("latin-1")), st.none(), st.integers())
)
def test_parser_never_raises_on_any_input(text):
    for fmt in ("tuple", "keyword"):
        result = parse_action(text, fmt)
        assert isinstance(result, Action | ParseFailure)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_env_step_never_raises_on_any_reply(text):
    env = make("maze_2d/tiny")
    env.reset(0)
    obs, reward, done, info = env.step(text)
    assert reward in (0.0, 1.0) and isinstance(obs.text, str)


def test_unknown_id_and_option_errors_name_what_is_accepted():
    with pytest.raises(EnvError, match="known ids: .*maze_2d/easy"):
        make("maze_2d/medium")
    with pytest.raises(EnvError, match="did you mean 'cell_px'"):
        make("maze_2d/easy", cell_size=10)
    with pytest.raises(EnvError, match="odd integer"):
        make("maze_2d/easy", grid_size=8)
    with pytest.raises(EnvError, match="action_format must be one of"):
        make("maze_2d/easy", action_format="json")


def test_registry_lists_easy_and_hard_with_visgym_budgets():
    specs = {s.env_id: s for s in list_envs()}
    assert specs["maze_2d/easy"].defaults == {"grid_size": 9, "max_turns": 20}
    assert specs["maze_2d/hard"].defaults == {"grid_size": 11, "max_turns": 30}
    assert make("maze_2d/hard").reset(0).images[0].size == (275, 275)


def test_room_layout_has_no_inner_walls_and_places_start_and_goal_anywhere():
    env = make("maze_2d/room")
    starts = set()
    for seed in range(50):
        env.reset(seed)
        assert not env.maze.walls[1:-1, 1:-1].any() and env.maze.walls[0].all()
        assert env.maze.start != env.maze.goal
        starts.add(env.maze.start)
        sx, sy = env.maze.start
        gx, gy = env.maze.goal
        assert env.optimal_path_length() == abs(sx - gx) + abs(sy - gy)
    assert len(starts) > 10
    with pytest.raises(EnvError, match="layout must be one of"):
        make("maze_2d/easy", layout="cave")


def test_eval_sets_hold_distinct_mazes():
    from clew.data.rows import generate_rows

    rows = generate_rows("maze_2d/room", 64, "eval")
    assert len({r.facts()["layout_key"] for r in rows}) == 64


def test_start_anywhere_moves_a_seeded_share_of_starts_to_solvable_open_cells():
    env = make("maze_2d/easy", start_anywhere=0.5, max_turns=32)
    plain = make("maze_2d/easy", max_turns=32)
    moved = []
    for seed in range(200):
        env.reset(seed)
        plain.reset(seed)
        assert env.maze.layout_key() == plain.maze.layout_key()  # same maze, same split
        assert plain.agent == plain.maze.start  # the default never moves a start
        if env.agent != plain.agent:
            moved.append(seed)
            assert not env.maze.walls[env.agent] and env.agent != env.maze.goal
            assert env.turns_needed() <= env.max_turns
            # the episode's optimal length is counted from where it starts
            assert env.optimal_path_length() == len(shortest_actions(env.maze, start=env.agent))
        first = env.agent
        env.reset(seed)
        assert env.agent == first  # every sample of a group starts on the same cell
    assert 70 <= len(moved) <= 130
    env.reset(moved[0])
    words = [
        ("right", "up", "left", "down")[a] for a in shortest_actions(env.maze, start=env.agent)
    ]
    obs, reward, done, info = _play(env, moved[0], [*words, "stop"])[-1]
    assert reward == 1.0 and info["done_reason"] == "stop"


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half", True])
def test_start_anywhere_out_of_range_says_what_is_accepted(bad):
    with pytest.raises(EnvError, match=r"start_anywhere must be a number in \[0, 1\]"):
        make("maze_2d/easy", start_anywhere=bad)


@pytest.mark.parametrize("env_id", ["maze_2d/easy", "maze_2d/room"])
def test_a_maze_names_its_state_exactly_when_its_frame_is_the_same(env_id):
    from clew.rollout.trajectory import state_key

    rng = np.random.default_rng(0)
    for seed in (3, 11):
        env = make(env_id, action_format="keyword")
        moves = [env.action_names()[d] for d in ("up", "down", "left", "right")]
        obs = env.reset(seed)
        names: dict[str, set[str]] = {}
        frames: dict[str, set[str]] = {}
        for _ in range(60):  # a random walk revisits cells
            digest = state_key(obs.images, obs.text)
            names.setdefault(obs.state, set()).add(digest)
            frames.setdefault(digest, set()).add(obs.state)
            obs, _, done, _ = env.step(moves[rng.integers(4)])
            if done:
                obs = env.reset(seed)
        assert len(names) > 3  # the walk saw several cells
        assert all(len(v) == 1 for v in names.values())
        assert all(len(v) == 1 for v in frames.values())
