"""Tests for clew.train.sft's supervised warm-up run (demonstrations: test_sft_demonstrations)."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
import torch
from safetensors.torch import load_file

from clew.data.rows import generate_rows
from clew.errors import ClewError, ConfigError
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.train.batch import collate
from clew.train.demonstrations import demonstrations, play_demonstration
from clew.train.sft import run_sft

OPTIONS = {"cell_px": 28, "action_format": "keyword"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rows():
    return generate_rows("maze_2d/tiny", 12, env_options=OPTIONS)


def test_short_sft_run_lowers_the_loss_and_saves_a_loadable_policy(model_dir, rows, tmp_path):
    evals: list[int] = []

    def eval_fn(model, chat, step):
        evals.append(step)
        return {"eval/calls": float(len(evals))}

    result = run_sft(
        model_dir,
        rows,
        tmp_path / "sft",
        steps=30,
        batch_size=4,
        lr=3e-3,
        eval_fn=eval_fn,
        eval_interval=10,
    )
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    assert last < 0.25 * first, result.losses
    assert evals == [10, 20, 30] and result.num_demonstrations == len(rows)
    model, processor = load_policy(result.output_dir)
    assert model.config.model_type == "qwen2_vl"
    assert (
        processor.tokenizer.convert_tokens_to_ids("<|im_end|>") == ChatFormat(processor).im_end_id
    )


def test_lora_sft_saves_merged_full_weights(model_dir, rows, tmp_path):
    result = run_sft(
        model_dir, rows[:4], tmp_path / "lora", steps=3, batch_size=2, lr=1e-2, lora_rank=4
    )
    assert not (result.output_dir / "adapter_config.json").exists()
    assert json.loads((result.output_dir / "config.json").read_text())["model_type"] == "qwen2_vl"
    before, after = (
        load_file(model_dir / "model.safetensors"),
        load_file(result.output_dir / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    # Only the language model's projections carry adapters (on disk the language model's
    # keys read "model.layers.N..." and the vision tower's "visual...").
    assert changed and all(k.endswith("_proj.weight") and "visual" not in k for k in changed)
    load_policy(result.output_dir)


def test_lora_sft_on_vision_and_language_changes_the_vision_tower_too(model_dir, rows, tmp_path):
    result = run_sft(
        model_dir,
        rows[:4],
        tmp_path / "lora_vl",
        steps=3,
        batch_size=2,
        lr=1e-2,
        lora_rank=4,
        lora_target_modules="vision_and_language",
    )
    before, after = (
        load_file(model_dir / "model.safetensors"),
        load_file(result.output_dir / "model.safetensors"),
    )
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("visual" in k for k in changed) and any("visual" not in k for k in changed)


def test_sft_with_an_image_window_hides_old_images_and_stops_on_its_time_budget(
    model_dir, chat, rows, tmp_path
):
    demos = demonstrations(rows[:2], chat)
    for demo in demos:
        demo.image_window = 1
    batch = collate(demos, chat)
    assert batch.visibility is not None
    # The last token of a multi-image episode sees its last image, not its first.
    longest = max(range(len(demos)), key=lambda i: len(demos[i].images))
    assert len(demos[longest].images) > 1
    ids = torch.tensor(demos[longest].token_ids)
    image_cols = (ids == chat.image_token_id).nonzero()[:, 0]
    last = len(ids) - 1
    seen = batch.visibility[longest, 0, last, image_cols]
    assert not seen[0] and seen[-1]

    result = run_sft(
        model_dir,
        rows,
        tmp_path / "timed",
        steps=1000,
        batch_size=2,
        lr=1e-3,
        keep_last_k_images=1,
        max_seconds=0.0,
    )
    assert len(result.losses) == 1
    load_policy(result.output_dir)
    with pytest.raises(ConfigError, match="keep_last_k_images"):
        run_sft(
            model_dir, rows, tmp_path / "bad", steps=1, batch_size=1, lr=1e-3, keep_last_k_images=0
        )


def test_sft_stops_at_the_first_evaluation_that_reaches_the_target_pass_rate(
    model_dir, rows, tmp_path
):
    seen: list[int] = []

    def eval_fn(model, chat, step):  # a solve rate that rises 0.2 per evaluation
        seen.append(step)
        return {"eval/all/pass_at_1": 0.2 * len(seen)}

    result = run_sft(
        model_dir,
        rows,
        tmp_path / "band",
        steps=50,
        batch_size=1,
        lr=1e-3,
        eval_fn=eval_fn,
        eval_interval=2,
        stop_at_pass=0.5,
    )
    assert seen == [2, 4, 6] and len(result.losses) == 6  # 0.2, 0.4, then 0.6 >= 0.5
    load_policy(result.output_dir)
    with pytest.raises(ConfigError, match=r"in \(0, 1\], got 50"):
        run_sft(
            model_dir,
            rows,
            tmp_path / "x",
            steps=1,
            batch_size=1,
            lr=1e-3,
            eval_fn=eval_fn,
            stop_at_pass=50,
        )
    with pytest.raises(ConfigError, match="needs an evaluation"):
        run_sft(model_dir, rows, tmp_path / "y", steps=1, batch_size=1, lr=1e-3, stop_at_pass=0.5)


def test_sft_saves_a_policy_every_save_interval_steps_besides_the_final_one(
    model_dir, rows, tmp_path
):
    out = tmp_path / "curve"
    run_sft(model_dir, rows, out, steps=5, batch_size=1, lr=3e-3, save_interval=2)
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2", "step_4"]
    early, final = load_policy(out / "step_2")[0], load_policy(out)[0]
    differ = [
        not torch.equal(a, b) for a, b in zip(early.parameters(), final.parameters(), strict=True)
    ]
    assert any(differ)  # a snapshot of step 2, not a copy of the final weights
    with pytest.raises(ConfigError, match="save_interval"):
        run_sft(model_dir, rows, tmp_path / "z", steps=1, batch_size=1, lr=1e-3, save_interval=-1)


def test_sft_keeps_the_best_evaluated_policy_with_its_step(model_dir, rows, tmp_path):
    scores = {1: 0.2, 2: 0.5, 3: 0.5, 4: 0.3}  # the tie at step 3 keeps step 2

    def eval_fn(model, chat, step):
        return {"eval/all/pass_at_1": scores[step]}

    out = tmp_path / "best_run"
    run_sft(
        model_dir, rows, out, steps=4, batch_size=1, lr=3e-3,
        eval_fn=eval_fn, eval_interval=1, save_interval=1, save_best=True,
    )  # fmt: skip
    record = json.loads((out / "best" / "best.json").read_text())
    assert record == {"step": 2, "eval/all/pass_at_1": 0.5}
    best, step2, final = (load_policy(d)[0] for d in (out / "best" / "policy", out / "step_2", out))
    assert all(
        torch.equal(a, b) for a, b in zip(best.parameters(), step2.parameters(), strict=True)
    )
    assert any(
        not torch.equal(a, b) for a, b in zip(best.parameters(), final.parameters(), strict=True)
    )
    with pytest.raises(ConfigError, match="save_best .--save-best. keeps the best evaluation"):
        run_sft(model_dir, rows, tmp_path / "n", steps=1, batch_size=1, lr=1e-3, save_best=True)


def test_sigterm_ends_sft_at_that_step_evaluated_and_saved(model_dir, rows, tmp_path):
    seen: list[int] = []

    def log(step, stats):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    def eval_fn(model, chat, step):
        seen.append(step)
        return {"eval/all/pass_at_1": 0.0}

    result = run_sft(
        model_dir,
        rows,
        tmp_path / "stopped",
        steps=50,
        batch_size=1,
        lr=1e-3,
        eval_fn=eval_fn,
        log=log,
    )
    # The signal came in step 2's log call: step 3 is the one it ends, evaluated as a last step.
    assert len(result.losses) == 3 and seen == [3]
    load_policy(result.output_dir)


def test_teacher_forced_first_turn_is_what_the_greedy_policy_plays(model_dir, rows, tmp_path):
    from clew.inference.engine import InferenceEngine
    from clew.inference.sampling import SamplingParams
    from clew.rollout.loop import RolloutSettings, play
    from clew.train.agreement import solver_agreement, solver_predictions

    # A little SFT first, so that the greedy policy writes actions in the format.
    trained = run_sft(model_dir, rows, tmp_path / "sft", steps=25, batch_size=4, lr=3e-3)
    model, processor = load_policy(trained.output_dir)
    chat = ChatFormat(processor)
    predictions = solver_predictions(model, chat, rows, image_window=1, batch_size=5)
    # The first turn's context is the same whether the solver or the policy has played:
    # the batched, padded forward must name the move the greedy engine makes there.
    settings = RolloutSettings(1, 4, 4096, SamplingParams(temperature=0.0, max_tokens=8), 1)
    greedy = play(InferenceEngine(model, chat), rows, settings, seed=0)
    first = {p.row: p.predicted for p in predictions if p.turn == 0}
    written = {i: greedy[i].actions[0].strip() for i in first}
    formatted = [i for i, text in written.items() if text.startswith("<action>")]
    assert len(formatted) >= len(first) // 2, written
    assert all(first[i] == written[i] for i in formatted), (first, written)
    # ... with the same log-probability the engine gave that word, to float rounding.
    for p in predictions:
        if p.turn == 0 and p.row in formatted:
            traj = greedy[p.row]
            word = traj.loss_mask.index(1) + 1  # "<action>", then the word
            assert p.logprob == pytest.approx(traj.logprobs[word], abs=1e-4)
    per_row = {i: sum(1 for p in predictions if p.row == i) for i in first}
    assert all(
        n == len(play_demonstration(rows[i], chat, random.Random(0)).actions)
        for i, n in per_row.items()
    )
    metrics = solver_agreement(model, chat, rows, image_window=1)
    turns = len(predictions)
    agree = sum(p.predicted in p.optimal for p in predictions)
    assert metrics["eval/agreement/all"] == pytest.approx(agree / turns)
    # A reply the solver would give on the goal is "stop", elsewhere a move that gets closer.
    assert all(p.optimal == {"<action>stop</action>"} for p in predictions if "goal" in p.groups)
    assert all(
        p.optimal and "<action>stop</action>" not in p.optimal
        for p in predictions
        if "goal" not in p.groups
    )


def test_sft_whose_gradient_stays_non_finite_stops_and_keeps_the_last_good_policy(
    model_dir, rows, tmp_path, monkeypatch
):
    real_backward = torch.Tensor.backward
    calls = {"n": 0}

    def backward_nan_after_two(self, *a, **k):
        calls["n"] += 1
        real_backward(self * float("nan") if calls["n"] > 2 else self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "backward", backward_nan_after_two)
    logged: list[dict[str, float]] = []
    with pytest.raises(ClewError, match=r"NaN or infinite at SFT steps 3-5.* policy of step 2"):
        run_sft(
            model_dir,
            rows,
            tmp_path / "sft",
            steps=20,
            batch_size=2,
            lr=1e-3,
            log=lambda step, stats: logged.append(stats),
        )
    monkeypatch.undo()
    assert [s["sft/skipped"] for s in logged] == [0, 0, 1, 1, 1]
    model, _ = load_policy(tmp_path / "sft")
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lora_rank": -1}, "lora_rank must be >= 0"),
        ({"lora_rank": 4, "lora_alpha": 0.0}, "lora_alpha must be > 0"),
        ({"lr": 0.0}, "lr must be > 0"),
        ({"warmup_steps": -2}, "warmup_steps must be >= 0"),
    ],
)
def test_sft_rejects_bad_settings_before_any_work(model_dir, rows, tmp_path, kwargs, message):
    settings = {"steps": 1, "batch_size": 1, "lr": 1e-3, **kwargs}
    with pytest.raises(ConfigError, match=message):
        run_sft(model_dir, rows[:1], tmp_path / "out", **settings)
    assert not (tmp_path / "out").exists()
