"""The agent client: `clew play` and `clew eval --endpoint` against `clew serve` on loopback."""

from __future__ import annotations

import argparse
import json
import socket

import pytest
from PIL import Image
from support.serve_cases import MODEL_ID, make_adapter, open_server, serving
from support.tiny import env_data, tiny_policy

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
    root = tmp_path_factory.mktemp("agent")
    base = tiny_policy(image_size=70, arch="qwen3_vl", patch_size=14, merge_size=1)
    adapter = make_adapter(base, root / "adapters" / "maze", rank=4, seed=5)
    data = env_data(ENV, 12, "eval", env_options=MAZE)
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


# An episode that outlasts the server's 8 images a request: keyword actions without "stop",
# and a goal that must be stopped on, so every episode plays all its turns.
LONG = {"cell_px": 14, "action_format": "keyword", "success_on_reach": False, "max_turns": 11}
NO_STOP = [*KEYWORD[:-1], "up,down,left,right"]


def _play(url, options, *extra):
    return main(["play", "--endpoint", url, "--model", MODEL_ID, "--env-id", ENV,
                 *(f"--option={k}={json.dumps(v)}" for k, v in options.items()),
                 *extra])  # fmt: skip


def test_play_outlasting_the_servers_image_limit_plays_every_turn_and_writes_its_gif(
    served, tmp_path, capsys
):
    url, *_ = served  # a server with clew serve's default of 8 images a request
    gif = tmp_path / "long.gif"
    assert _play(url, LONG, "--seed", "2", "--gif", str(gif), *NO_STOP) == 0
    captured = capsys.readouterr()
    assert "in 11 turns" in captured.out and "ended by max_turns" in captured.out
    assert gif.is_file() and f"wrote {gif}" in captured.out
    assert "at most 8 images per request" in captured.err  # said once, after the episode


def test_the_image_limit_is_learnt_from_the_servers_refusal(served, tmp_path, capsys):
    from clew.agent import Endpoint, play_episode
    from clew.agent.episode import count_images
    from clew.agent.flags import add_generation_args, rollout_settings
    from clew.serve.prompt import PromptLimits

    _, base, *_ = served
    with serving(open_server(base, limits=PromptLimits(max_images=3))) as url:
        gif = tmp_path / "three.gif"
        options = {**LONG, "max_turns": 5}
        assert _play(url, options, "--gif", str(gif), *NO_STOP) == 0
        out = capsys.readouterr()
        assert "in 5 turns" in out.out and gif.is_file()
        assert "at most 3 images per request" in out.err
        # Each request held at most 3 images, the turns past them as their text alone.
        sent = []
        endpoint = Endpoint(url, MODEL_ID)
        real = endpoint.reply

        def record(messages, *args, **kwargs):
            sent.append(messages)
            return real(messages, *args, **kwargs)

        endpoint.reply = record
        parser = argparse.ArgumentParser()
        add_generation_args(parser)
        settings = rollout_settings(parser.parse_args(NO_STOP), 5)
        traj = play_episode(endpoint, ENV, options, 0, settings)
    assert traj.turns == 5 and traj.end_reason == "max_turns" and endpoint.max_images == 3
    images = [count_images(m) for m in sent]
    assert images == [1, 2, 3, 4, 3, 3]  # turn 4's request refused, sent again with 3
    assert [m["content"][0]["type"] for m in sent[-1] if m["role"] == "user"] == [
        "text", "text", "image_url", "image_url", "image_url"
    ]  # fmt: skip


def test_eval_through_the_endpoint_outlasting_the_image_limit_writes_its_metrics(served, tmp_path):
    url, *_ = served
    data = env_data(ENV, 2, "eval", env_options=LONG)
    out = tmp_path / "long-eval"
    code = main(["eval", "--endpoint", url, "--model", MODEL_ID, "--data", str(data),
                 "--output-dir", str(out), "--num-gifs", "1", *NO_STOP])  # fmt: skip
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval/all/episodes"] == 2 and metrics["eval/all/mean_turns"] == 11
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [t["end_reason"] for t in trajs] == ["max_turns", "max_turns"]


def _refuse_from_the_third_request(monkeypatch):
    """Endpoint.reply answering as the server does, but refusing (HTTP 500) each episode's
    requests from its turn 3 on."""
    from clew.agent import endpoint as module

    real = module.Endpoint.reply

    def reply(self, messages, *args, **kwargs):
        replies = sum(m["role"] == "assistant" for m in messages) - 1  # less the reply prefix
        if replies >= 2:
            raise module.RequestRefused(self.url, 500, "generation failed")
        return real(self, messages, *args, **kwargs)

    monkeypatch.setattr(module.Endpoint, "reply", reply)


def test_play_cut_short_by_the_server_writes_its_gif_with_the_reason(
    served, tmp_path, capsys, monkeypatch
):
    url, *_ = served
    _refuse_from_the_third_request(monkeypatch)
    gif = tmp_path / "cut.gif"
    assert _play(url, LONG, "--gif", str(gif), *NO_STOP) == 1
    captured = capsys.readouterr()
    assert "in 2 turns" in captured.out and "ended by server_error" in captured.out
    assert "the server refused the request of turn 3: HTTP 500: generation failed" in captured.out
    assert gif.is_file() and "cut short by the server" in captured.err


def test_eval_cut_short_by_the_server_writes_what_it_played(served, tmp_path, capsys, monkeypatch):
    url, *_ = served
    data = env_data(ENV, 2, "eval", env_options=LONG)
    _refuse_from_the_third_request(monkeypatch)
    out = tmp_path / "cut-eval"
    code = main(["eval", "--endpoint", url, "--model", MODEL_ID, "--data", str(data),
                 "--output-dir", str(out), "--num-gifs", "1", *NO_STOP])  # fmt: skip
    assert code == 1
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [(t["turns"], t["end_reason"]) for t in trajs] == [(2, "server_error")] * 2
    assert "HTTP 500: generation failed" in trajs[0]["error"]
    assert json.loads((out / "metrics.json").read_text())["eval/all/episodes"] == 2
    assert "2 of 2 episodes were cut short by the server" in capsys.readouterr().err


def test_a_refused_first_request_is_still_a_one_line_error(served, capsys):
    url, *_ = served
    code = _play(url, {"max_turns": 2}, "--allowed-tokens", "not-a-token")
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "answered HTTP 400" in err


def test_keyword_replies_to_a_tuple_env_get_a_hint_naming_the_option(served, tmp_path, capsys):
    url, *_ = served
    assert _play(url, {"cell_px": 14, "max_turns": 3}, *KEYWORD) == 0
    err = capsys.readouterr().err
    assert "3 of 3 replies could not be read as maze_2d/room actions" in err
    assert "look like keyword actions" in err and "add --option action_format=keyword" in err
    # clew eval's rows carry their env options: the hint says how to make them.
    rows = generate_rows(ENV, 2, "eval", env_options={"cell_px": 14, "max_turns": 2})
    data = write_rows(rows, tmp_path / "tuple.parquet")
    code = main(["eval", "--endpoint", url, "--model", MODEL_ID, "--data", str(data),
                 "--output-dir", str(tmp_path / "hint"), *KEYWORD])  # fmt: skip
    assert code == 0
    assert "`clew dataset --split eval --option action_format=keyword`" in capsys.readouterr().err
    # Replies the env reads get no hint.
    assert _play(url, MAZE, *KEYWORD) == 0
    assert "hint" not in capsys.readouterr().err


def test_the_parse_hint_names_the_format_the_replies_are_in():
    from clew.agent.hints import dataset_advice, parse_hint
    from clew.rollout.trajectory import Trajectory

    def played(options, replies):
        traj = Trajectory("maze_2d/easy", options, 0, 0, 0)
        traj.actions = list(replies)
        traj.infos = [{"parse_error": True, "note": "could not parse"} for _ in replies]
        return traj

    tuples = played({"action_format": "keyword"}, ["('move', 1)", "('stop', 'stop')"])
    assert "add --option action_format=tuple " in parse_hint([tuples])
    # VisGym's and SkyRL's prompt formats read tuples only: keywords need clew's too.
    skyrl = played({"prompt_format": "skyrl-visgym"}, ["<action>up</action>"] * 2)
    assert "--option action_format=keyword --option prompt_format=clew" in parse_hint([skyrl])
    through_eval = parse_hint([skyrl], dataset_advice)
    assert "--option action_format=keyword`" in through_eval
    assert "--prompt-format clew" in through_eval
    neither = parse_hint([played({}, ["hello", "world"])])
    assert "look like neither format" in neither
    most_read = played({}, ["x", "y", "z"])
    most_read.infos[0]["parse_error"] = most_read.infos[1]["parse_error"] = False
    assert parse_hint([most_read]) is None
