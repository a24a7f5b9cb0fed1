"""Datasets of seeded episodes (mazes here), their statistics, and episode pictures, through
the CLI too; reading the parquet files of the maze-only rows that came before."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from clew.cli import main
from clew.data.rows import (
    Row,
    dataset_stats,
    generate_rows,
    read_rows,
    task_keys,
    write_rows,
)
from clew.envs import make
from clew.envs.maze.dataset import split_of_layout
from clew.envs.maze.solver import shortest_actions
from clew.errors import DataError


def test_dataset_round_trip_keeps_every_field(tmp_path):
    rows = generate_rows("maze_2d/easy", 20, "train", env_options={"action_format": "keyword"})
    path = write_rows(rows, tmp_path / "train.parquet")
    assert read_rows(path) == rows
    row = rows[0]
    env = make(row.env_id, **row.options())
    env.reset(row.seed)
    assert env.prompt == row.prompt
    assert row.facts() == {
        "optimal_path_length": env.optimal_path_length(),
        "turns_needed": env.turns_needed(),
        "solvable": env.turns_needed() <= env.max_turns,
        "layout_key": env.maze.layout_key(),
    }
    assert row.options()["action_format"] == "keyword"


def test_train_and_eval_never_share_a_maze_even_from_the_same_seeds():
    train = generate_rows("maze_2d/small", 300, "train", seed_start=0)
    evals = generate_rows("maze_2d/small", 30, "eval", seed_start=0)
    keys = {r.facts()["layout_key"] for r in train}
    assert keys.isdisjoint({r.facts()["layout_key"] for r in evals})
    assert all(split_of_layout(r.facts()["layout_key"]) == "eval" for r in evals)
    default_eval = generate_rows("maze_2d/easy", 64, "eval")
    assert min(r.seed for r in default_eval) >= 1_000_000_000


def test_rows_drawn_with_exclude_repeat_none_of_the_excluded_tasks():
    def keys(rows):
        return {r.facts()["layout_key"] for r in rows}

    held = generate_rows("maze_2d/small", 6, "eval", seed_start=0)[::2]
    plain = generate_rows("maze_2d/small", 12, "eval", seed_start=0)
    drawn = generate_rows("maze_2d/small", 12, "eval", seed_start=0, exclude=held)
    assert keys(plain) >= keys(held)  # the same walk without exclude repeats them all
    assert len(drawn) == 12 and keys(drawn).isdisjoint(keys(held))
    assert task_keys(held) == keys(held)
    # An env that names no task key: an excluded row's task is its seed.
    import envs_for_tests  # noqa: F401  (registers test/digits)

    first = generate_rows("test/digits", 2)
    assert [r.seed for r in generate_rows("test/digits", 3, exclude=first)] == [2, 3, 4]


def test_stats_count_path_lengths_and_the_solvable_share():
    rows = generate_rows("maze_2d/easy", 64, "eval", env_options={"max_turns": 13})
    stats = dataset_stats(rows)
    assert sum(stats["path_length_histogram"].values()) == 64
    # With 13 turns only the 12-move mazes (12 moves + stop) are solvable.
    expected = sum(1 for r in rows if r.facts()["optimal_path_length"] <= 12) / 64
    assert stats["solvable_share"] == pytest.approx(expected)
    assert 0 < expected < 1


def test_parquet_of_the_earlier_maze_rows_reads_into_metadata(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = generate_rows("maze_2d/tiny", 3)
    old = [
        {
            "env_id": r.env_id, "env_options": r.env_options, "seed": r.seed, "split": r.split,
            "prompt": r.prompt, "max_turns": r.max_turns, **r.facts(),
        }
        for r in rows
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(old), tmp_path / "old.parquet")
    assert read_rows(tmp_path / "old.parquet") == rows
    assert all(r.solvable and r.turns_needed == r.facts()["turns_needed"] for r in rows)
    pq.write_table(pa.Table.from_pylist([{"env_id": "x", "seed": 1}]), tmp_path / "other.parquet")
    with pytest.raises(DataError, match="lacks the column"):
        read_rows(tmp_path / "other.parquet")


def test_a_row_takes_its_options_and_metadata_as_dicts_or_json():
    as_dict = Row("maze_2d/tiny", {"b": 1, "a": 2}, 0, "train", "p", 10, {"solvable": False})
    as_json = Row("maze_2d/tiny", '{"a": 2, "b": 1}', 0, "train", "p", 10, '{"solvable": false}')
    assert as_dict == as_json and hash(as_dict) == hash(as_json)
    assert not as_dict.solvable and as_dict.turns_needed is None
    assert Row("maze_2d/tiny", "{}", 0, "train", "p", 10).solvable  # no claim: solvable


def test_dataset_command_writes_and_prints_stats(tmp_path, capsys):
    assert main(["dataset", "--num-rows", "8", "--output-dir", str(tmp_path), "--stats"]) == 0
    out = capsys.readouterr().out
    assert "solvable within the turn budget" in out and (tmp_path / "train.parquet").is_file()
    assert main(["dataset", "--stats", "--input", str(tmp_path / "train.parquet")]) == 0
    assert "rows: 8" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["dataset", "--env-id", "maze_2d/eazy", "--output-dir", "{tmp}"],
            "did you mean 'maze_2d/easy'",
        ),
        (["dataset", "--option", "sizes=3", "--output-dir", "{tmp}"], "accepted options"),
        (["dataset", "--output-dir", "{tmp}/file.txt/sub"], "cannot write the dataset"),
        (["dataset", "--stats", "--input", "{tmp}/missing.parquet"], "does not exist"),
        (["render", "--actions", "up,north", "--output", "{tmp}/x"], "unknown action"),
    ],
)
def test_bad_input_gives_one_clear_line_and_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "file.txt").write_text("not a folder")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_non_positive_row_count_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["dataset", "--num-rows", "-3", "--output-dir", "/tmp/never"])
    assert exc.value.code == 2
    assert "positive integer" in capsys.readouterr().err
    with pytest.raises(DataError, match="positive integer"):
        generate_rows("maze_2d/easy", 0)


def test_failed_write_keeps_the_existing_dataset(tmp_path, monkeypatch):
    rows = generate_rows("maze_2d/tiny", 4)
    path = write_rows(rows, tmp_path / "train.parquet")

    def disk_full(table, where, **kwargs):
        with open(where, "wb") as f:
            f.write(b"PAR1 half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pyarrow.parquet.write_table", disk_full)
    with pytest.raises(DataError, match="No space left"):
        write_rows(generate_rows("maze_2d/tiny", 8), path)
    assert read_rows(path) == rows


def test_render_writes_gif_and_contact_sheet_of_the_solution(tmp_path, capsys):
    assert main(["render", "--solve", "--seed", "3", "--output", str(tmp_path / "ep")]) == 0
    assert "reward 1.0" in capsys.readouterr().out
    gif = Image.open(tmp_path / "ep.gif")
    # start + 12 moves; the stop frame equals the last move's, and GIF merges repeats.
    assert gif.n_frames == 13
    sheet = Image.open(tmp_path / "ep.png")
    assert sheet.width > 225 * 3


def test_render_replays_a_recorded_trajectory(tmp_path, capsys):
    env = make("maze_2d/tiny", action_format="keyword")
    env.reset(2)
    first = ("right", "up", "left", "down")[shortest_actions(env.maze)[0]]
    rec = {
        "env_id": "maze_2d/tiny",
        "env_options": {"action_format": "keyword"},
        "seed": 2,
        "actions": [f"<action>{first}</action>", "hmm", "<action>stop</action>"],
    }
    (tmp_path / "t.jsonl").write_text(json.dumps(rec) + "\n")
    assert (
        main(["render", "--trajectory", str(tmp_path / "t.jsonl"), "--output", str(tmp_path / "t")])
        == 0
    )
    assert "3 turns" in capsys.readouterr().out
    assert Image.open(tmp_path / "t.gif").n_frames >= 2
