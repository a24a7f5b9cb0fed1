"""Datasets of seeded mazes, their statistics, and episode pictures, through the CLI too."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from clew.cli import main
from clew.data.rows import dataset_stats, generate_rows, read_rows, split_of_layout, write_rows
from clew.envs import make
from clew.envs.maze.solver import shortest_actions
from clew.errors import DataError


def test_dataset_round_trip_keeps_every_field(tmp_path):
    rows = generate_rows("maze_2d/easy", 20, "train", env_options={"action_format": "keyword"})
    path = write_rows(rows, tmp_path / "train.parquet")
    assert read_rows(path) == rows
    row = rows[0]
    env = make(row.env_id, **row.options())
    env.reset(row.seed)
    assert env.prompt == row.prompt and env.optimal_path_length() == row.optimal_path_length
    assert row.options()["action_format"] == "keyword"


def test_train_and_eval_never_share_a_maze_even_from_the_same_seeds():
    train = generate_rows("maze_2d/small", 300, "train", seed_start=0)
    evals = generate_rows("maze_2d/small", 30, "eval", seed_start=0)
    assert {r.layout_key for r in train}.isdisjoint({r.layout_key for r in evals})
    assert all(split_of_layout(r.layout_key) == "eval" for r in evals)
    default_eval = generate_rows("maze_2d/easy", 64, "eval")
    assert min(r.seed for r in default_eval) >= 1_000_000_000


def test_stats_count_path_lengths_and_the_solvable_share():
    rows = generate_rows("maze_2d/easy", 64, "eval", env_options={"max_turns": 13})
    stats = dataset_stats(rows)
    assert sum(stats["path_length_histogram"].values()) == 64
    # With 13 turns only the 12-move mazes (12 moves + stop) are solvable.
    expected = sum(1 for r in rows if r.optimal_path_length <= 12) / 64
    assert stats["solvable_share"] == pytest.approx(expected)
    assert 0 < expected < 1


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
