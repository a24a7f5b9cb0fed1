"""The agent client: `clew play` and `clew eval --endpoint` against `clew serve` on loopback."""

from __future__ import annotations

import json
import socket

import pytest
from PIL import Image
from serve_support import MODEL_ID, make_adapter, open_server, serving

from clew.agent import Conversation
from clew.cli import main
from clew.data.rows import generate_rows, write_rows

ENV = "maze_2d/room"
MAZE = {"cell_px": 14, "action_format": "keyword", "max_turns": 6}
KEYWORD = [
    "--reply-prefix", "<action>", "--reply-suffix", "</action>", "--max-generate-length", "1",
    "--allowed-tokens", "up,down,left,right,stop",
]  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory, one_thread):
    """(url, base, adapter folder, eval parquet): the tiny base and one adapter, served."""
    from clew.models import build_model

    root = tmp_path_factory.mktemp("agent")
    base = build_model(
        "tiny", root / "base", image_size=70, arch="qwen3_vl", patch_size=14, merge_size=1
    ).path
    adapter = make_adapter(base, root / "adapters" / "maze", rank=4, seed=5)
    data = write_rows(generate_rows(ENV, 12, "eval", env_options=MAZE), root / "eval.parquet")
    with serving(open_server(base, adapters=str(root / "adapters"))) as url:
        yield url, base, adapter, data


def _eval(tmp_path, name, args):
    out = tmp_path / name
    code = main(["eval", "--data", *args[:1], "--output-dir", str(out), "--num-gifs", "1",
                 *KEYWORD, *args[1:]])  # fmt: skip
    assert code == 0
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    return json.loads((out / "metrics.json").read_text()), trajs, out


def test_greedy_eval_through_the_endpoint_equals_in_process_eval_of_the_adapter(served, tmp_path):
    url, base, adapter, data = served
    local = ["--model", str(base), "--adapter", str(adapter), "--device", "cpu"]
    metrics, trajs, _ = _eval(tmp_path, "local", [str(data), *local])
    remote = ["--endpoint", url, "--model", f"{MODEL_ID}:maze", "--concurrency", "3"]
    metrics_r, trajs_r, out = _eval(tmp_path, "remote", [str(data), *remote])
    assert metrics_r["eval/all/pass_at_1"] == metrics["eval/all/pass_at_1"]
    assert metrics_r == metrics
    assert [t["actions"] for t in trajs_r] == [t["actions"] for t in trajs]
    assert [(t["seed"], t["end_reason"], t["reward"]) for t in trajs_r] == [
        (t["seed"], t["end_reason"], t["reward"]) for t in trajs
    ]
    assert len(trajs) == 12 and sum(t["turns"] for t in trajs) > 12
    assert metrics["eval/all/pass_at_1"] > 0  # some mazes solved, some not
    assert list((out / "gifs").glob("*.gif"))
    # The adapter is what played: the base alone plays these mazes otherwise.
    _, trajs_base, _ = _eval(tmp_path, "base", [str(data), "--model", str(base), "--device", "cpu"])
    assert [t["actions"] for t in trajs_base] != [t["actions"] for t in trajs]


def test_play_prints_each_turn_and_writes_the_episode_as_a_gif(served, tmp_path, capsys):
    url, *_ = served
    gif = tmp_path / "play" / "episode.gif"
    code = main(["play", "--endpoint", url, "--model", f"{MODEL_ID}:maze",
                 "--env-id", ENV, *(f"--option={k}={v}" for k, v in MAZE.items()),
                 "--seed", "3", "--gif", str(gif), *KEYWORD])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    turns = [line for line in out.splitlines() if line.startswith("turn ")]
    assert turns and turns[0].startswith("turn 1: '<action>")
    assert f"in {len(turns)} turns" in out and f"wrote {gif}" in out
    with Image.open(gif) as im:
        assert im.size == (98, 98)
        # A frame per turn after the start (identical frames, wall bumps, merge into one
        # shown as long), the last one held 4x.
        shown = 0
        for i in range(im.n_frames):
            im.seek(i)
            shown += im.info["duration"]
        assert shown == 400 * len(turns) + 1600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _play_error(capsys, url, model):
    code = main(["play", "--endpoint", url, "--model", model, "--env-id", "maze_2d/small"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err
    return err


def test_an_unreachable_endpoint_is_a_one_line_error(capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    err = _play_error(capsys, url, MODEL_ID)
    assert err.startswith("clew play: error: the endpoint") and "unreachable" in err


def test_an_unknown_model_or_adapter_is_a_one_line_error_naming_what_is_served(served, capsys):
    url, *_ = served
    for model in ("no-such-model", f"{MODEL_ID}:nope"):
        err = _play_error(capsys, url, model)
        assert f"{model!r} is not served here" in err and f"{MODEL_ID}:maze" in err


def test_only_the_last_k_frames_are_sent_as_images():
    conv = Conversation()
    for i in range(3):
        conv.add_observation(f"turn {i}", [Image.new("RGB", (8, 8), (i * 40, 0, 0))])
        conv.add_reply("<action>up</action>")
    conv.add_observation("turn 3", [Image.new("RGB", (8, 8), "white")])
    messages = conv.messages(reply_prefix="<action>", keep_last_k_images=2)
    images = [
        sum(p["type"] == "image_url" for p in m["content"]) for m in messages if m["role"] == "user"
    ]
    assert images == [0, 0, 1, 1]
    assert messages[-1] == {"role": "assistant", "content": "<action>"}
    assert [m["content"][-1]["text"] for m in messages if m["role"] == "user"][0] == "turn 0"
    assert all(len(m["content"]) == 2 for m in conv.messages() if m["role"] == "user")


def test_a_missing_or_wrong_api_key_is_a_one_line_error_naming_the_flag(served, capsys):
    _, base, *_ = served
    with serving(open_server(base, api_key="secret")) as url:
        capsys.readouterr()  # the weights' loading bars
        err = _play_error(capsys, url, MODEL_ID)
        assert "refused the API key" in err and "--api-key" in err
        code = main(["play", "--endpoint", url, "--model", MODEL_ID, "--api-key", "secret",
                     "--env-id", ENV, "--max-turns", "1", "--max-generate-length", "2"])  # fmt: skip
        assert code == 0 and "in 1 turns" in capsys.readouterr().out


def test_an_observation_is_sent_in_its_layout_after_the_episodes_system_prompt():
    conv = Conversation(system="Solve the maze.")
    frame = Image.new("RGB", (8, 8), "white")
    conv.add_observation("text first", [frame], text_first=True)
    conv.add_reply("<action>up</action>")
    conv.add_observation("image first", [frame])
    messages = conv.messages()
    assert messages[0] == {"role": "system", "content": "Solve the maze."}
    users = [[p["type"] for p in m["content"]] for m in messages if m["role"] == "user"]
    assert users == [["text", "image_url"], ["image_url", "text"]]
    assert Conversation().messages()[:1] == []  # no system prompt: no system message
