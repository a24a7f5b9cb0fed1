"""`clew eval`: a policy is evaluated the way it was trained (reply format, visible frames)."""

from __future__ import annotations

import json

from support.tiny import env_data, tiny_policy

from clew.cli import main
from clew.envs.base import text_corpus


def _tiny_policy_and_mazes():
    """What `clew init-model --preset tiny --arch qwen3_vl --image-size 70 --patch-size 14
    --merge-size 1` builds (the envs' text corpus), and two small mazes: shared, read only."""
    model = tiny_policy(
        corpus=text_corpus(), arch="qwen3_vl", image_size=70, patch_size=14, merge_size=1
    )
    opts = {"cell_px": 14, "action_format": "keyword", "max_turns": 3}
    return model, env_data("maze_2d/small", 2, "eval", env_options=opts)


def test_eval_writes_the_reply_prefix_and_suffix_around_each_sampled_reply(tmp_path, capsys):
    model, data = _tiny_policy_and_mazes()
    out = tmp_path / "eval"
    args = ["eval", "--model", str(model), "--data", str(data), "--output-dir", str(out)]
    forced = ["--reply-prefix", "<action>", "--reply-suffix", "</action>"]
    code = main([*args, *forced, "--max-generate-length", "1", "--keep-last-k-images", "1",
                 "--num-gifs", "0", "--device", "cpu"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "eval/all/pass_at_1" in printed and "eval/all/reward_pass_at_1" in printed
    # The walkthrough's pass rule and clew's solve rate, side by side on one line.
    both = [line for line in printed.splitlines() if "pass_at_1 (reward > 0" in line]
    assert len(both) == 1 and "solve rate (stopped on the goal)" in both[0]
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 and all(t["turns"] >= 1 for t in trajs)
    for t in trajs:
        assert t["generated_tokens"] == t["turns"]  # one sampled token a turn, the rest written
        for action in t["actions"]:
            assert action.startswith("<action>") and action.endswith("</action>")


def test_eval_samples_each_maze_n_times_and_reports_pass_at_n(tmp_path, capsys):
    model, data = _tiny_policy_and_mazes()
    out = tmp_path / "eval"
    code = main(["eval", "--model", str(model), "--data", str(data), "--output-dir", str(out),
                 "--max-generate-length", "4", "--num-gifs", "0", "--device", "cpu",
                 "--temperature", "1.0", "--n-samples-per-prompt", "3", "--seed", "7"])  # fmt: skip
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert metrics["eval/all/episodes"] == 6.0 and len(trajs) == 6
    assert sorted(t["sample_index"] for t in trajs) == [0, 0, 1, 1, 2, 2]
    # pass@1: the share of the 6 episodes solved; pass@3: of the 2 mazes, with a solved sample.
    assert metrics["eval/all/pass_at_1"] == sum(t["success"] for t in trajs) / 6
    solved = {
        seed: any(t["success"] for t in trajs if t["seed"] == seed)
        for seed in {t["seed"] for t in trajs}
    }
    assert len(solved) == 2 and metrics["eval/all/pass_at_3"] == sum(solved.values()) / 2
    assert metrics["eval/all/pass_at_3"] >= metrics["eval/all/pass_at_1"]


def test_eval_refuses_several_greedy_samples_with_the_rule(capsys):
    model, data = _tiny_policy_and_mazes()
    code = main(["eval", "--model", str(model), "--data", str(data),
                 "--n-samples-per-prompt", "4"])  # fmt: skip
    assert code != 0
    assert "needs --temperature > 0" in capsys.readouterr().err


def test_eval_with_allowed_tokens_plays_only_those_words(tmp_path, capsys):
    model, data = _tiny_policy_and_mazes()
    out = tmp_path / "eval"
    code = main(["eval", "--model", str(model), "--data", str(data), "--output-dir", str(out),
                 "--reply-prefix", "<action>", "--reply-suffix", "</action>",
                 "--max-generate-length", "1", "--allowed-tokens", "up,down,left,right,stop",
                 "--temperature", "1.0", "--num-gifs", "0", "--device", "cpu"])  # fmt: skip
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    words = {f"<action>{w}</action>" for w in ("up", "down", "left", "right", "stop")}
    assert all(a in words for t in trajs for a in t["actions"])
    assert metrics["eval/all/parse_error_rate"] == 0.0


def test_eval_refuses_an_allowed_token_that_is_not_one_token(capsys):
    model, data = _tiny_policy_and_mazes()
    code = main(["eval", "--model", str(model), "--data", str(data), "--device", "cpu",
                 "--allowed-tokens", "up,go north"])  # fmt: skip
    assert code != 0
    assert "'go north' is" in capsys.readouterr().err


def test_eval_with_enforce_eager_plays_what_the_default_plays(tmp_path, capsys):
    model, data = _tiny_policy_and_mazes()
    runs = []
    for extra in ([], ["--enforce-eager"]):
        out = tmp_path / f"eval{len(runs)}"
        code = main(["eval", "--model", str(model), "--data", str(data), "--output-dir", str(out),
                     "--max-generate-length", "4", "--num-gifs", "0", "--device", "cpu",
                     "--temperature", "1.0", "--seed", "3", *extra])  # fmt: skip
        assert code == 0
        runs.append((out / "trajectories.jsonl").read_text())
    assert runs[0] == runs[1]  # on a CPU both step eagerly
