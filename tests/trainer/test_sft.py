"""The SFT stage (clew.trainer.sft, clew.trainer.sft_launch.run_sft_stage); demonstrations:
test_sft_demonstrations; the command and resuming: test_sft_resume."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clew.config import load_config
from clew.data.rows import generate_rows, write_rows
from clew.errors import ClewError, ConfigError
from clew.metrics import read_history
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.train.model_batch import collate
from clew.trainer.demonstrations import demonstrations, play_demonstration
from clew.trainer.sft import DemonstrationStream
from clew.trainer.sft_launch import run_sft_stage

OPTIONS = {"cell_px": 28, "action_format": "keyword"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rows():
    return generate_rows("maze_2d/tiny", 12, env_options=OPTIONS)


@pytest.fixture(scope="module")
def data(rows, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    write_rows(rows, path)
    return path


def sft_config(model_dir, data, tmp_path, *overrides: str):
    """A config for an SFT run in ``tmp_path/runs/sft``; ``overrides`` on top."""
    return load_config(
        None,
        [
            f"sft.model_path={model_dir}",
            f"data.train_data=['{data}']",
            f"trainer.log_path={tmp_path / 'runs'}",
            "trainer.logger=jsonl",
            "sft.batch_size=1",
            *overrides,
        ],
    )


def history(result) -> dict[int, dict[str, float]]:
    return {r["step"]: r for r in read_history(result.run_dir)}


def test_short_sft_run_lowers_the_loss_and_exports_a_loadable_policy(
    model_dir, rows, data, tmp_path
):
    evals: list[int] = []

    def eval_fn(model, chat, step):
        evals.append(step)
        return {"eval/all/pass_at_1": 0.1 * len(evals)}

    cfg = sft_config(
        model_dir, data, tmp_path,
        "sft.steps=30", "sft.batch_size=4", "sft.optimizer_config.lr=3e-3", "sft.eval_interval=10",
    )  # fmt: skip
    result = run_sft_stage(cfg, eval_fn=eval_fn)
    losses = [r["sft/loss"] for r in history(result).values()]
    first, last = losses[0], sum(losses[-5:]) / 5
    assert len(losses) == 30 and last < 0.25 * first, losses
    assert evals == [10, 20, 30] and result.num_demonstrations == len(rows)
    assert result.first_eval == {"eval/all/pass_at_1": pytest.approx(0.1)}
    assert result.last_eval == {"eval/all/pass_at_1": pytest.approx(0.3)}
    assert result.final_policy == str(tmp_path / "runs" / "sft" / "exports" / "final" / "policy")
    model, processor = load_policy(result.final_policy)
    assert model.config.model_type == "qwen2_vl"
    assert (
        processor.tokenizer.convert_tokens_to_ids("<|im_end|>") == ChatFormat(processor).im_end_id
    )


def _changed(model_dir, policy) -> set[str]:
    before = load_file(Path(model_dir) / "model.safetensors")
    after = load_file(Path(policy) / "model.safetensors")
    assert before.keys() == after.keys()
    return {k for k in before if not torch.equal(before[k], after[k])}


def test_lora_sft_exports_merged_full_weights(model_dir, data, tmp_path):
    cfg = sft_config(
        model_dir, data, tmp_path,
        "sft.steps=3", "sft.batch_size=2", "sft.optimizer_config.lr=1e-2", "sft.lora.rank=4",
    )  # fmt: skip
    policy = Path(run_sft_stage(cfg).final_policy)
    assert not (policy / "adapter_config.json").exists()
    assert json.loads((policy / "config.json").read_text())["model_type"] == "qwen2_vl"
    changed = _changed(model_dir, policy)
    # Only the language model's projections carry adapters (on disk the language model's
    # keys read "model.layers.N..." and the vision tower's "visual...").
    assert changed and all(k.endswith("_proj.weight") and "visual" not in k for k in changed)
    load_policy(policy)


def test_lora_sft_on_vision_and_language_changes_the_vision_tower_too(model_dir, data, tmp_path):
    cfg = sft_config(
        model_dir, data, tmp_path,
        "sft.steps=3", "sft.batch_size=2", "sft.optimizer_config.lr=1e-2", "sft.lora.rank=4",
        "sft.lora.target_modules=vision_and_language",
    )  # fmt: skip
    changed = _changed(model_dir, run_sft_stage(cfg).final_policy)
    assert any("visual" in k for k in changed) and any("visual" not in k for k in changed)


def test_demonstration_batches_are_a_function_of_the_seed_and_the_step(rows, chat):
    stream = DemonstrationStream(rows[:5], chat, 3, seed=4, detour_prob=0.3, image_window=1)
    again = DemonstrationStream(rows[:5], chat, 3, seed=4, detour_prob=0.3, image_window=1)
    batches = [stream.batch(k) for k in range(4)]  # 12 rows: two passes and a bit
    assert [d.token_ids for d in again.batch(2)] == [d.token_ids for d in batches[2]]
    walk = [d for b in batches for d in b]
    seeds = [d.row_seed for d in walk]
    assert sorted(seeds[:5]) == sorted(seeds[5:10]) == sorted(r.seed for r in rows[:5])
    assert seeds[:5] != seeds[5:10]  # each pass in its own order
    assert all(d.image_window == 1 for d in walk)
    # A demonstration is what `demonstrations` plays for its row with its pass's seed.
    by_seed = {r.seed: r for r in rows[:5]}
    for k, demo in enumerate(walk):
        expected = demonstrations([by_seed[demo.row_seed]], chat, 0.3, 4 + k // 5)[0]
        assert demo.token_ids == expected.token_ids


def test_sft_with_an_image_window_hides_old_images_and_stops_on_its_time_budget(
    model_dir, chat, rows, data, tmp_path
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

    cfg = sft_config(
        model_dir, data, tmp_path,
        "sft.steps=1000", "sft.batch_size=2", "generator.keep_last_k_images=1",
        "sft.max_minutes=1e-9",
    )  # fmt: skip
    result = run_sft_stage(cfg)
    assert result.step == 1 and list(history(result)) == [1]
    load_policy(result.final_policy)
    with pytest.raises(ConfigError, match="keep_last_k_images must be >= 1"):
        sft_config(model_dir, data, tmp_path, "generator.keep_last_k_images=0")


def test_sft_stops_at_the_first_evaluation_that_reaches_the_target_pass_rate(
    model_dir, data, tmp_path
):
    seen: list[int] = []

    def eval_fn(model, chat, step):  # a solve rate that rises 0.2 per evaluation
        seen.append(step)
        return {"eval/all/pass_at_1": 0.2 * len(seen)}

    cfg = sft_config(
        model_dir, data, tmp_path, "sft.steps=50", "sft.eval_interval=2", "sft.stop_at_pass=0.5"
    )
    result = run_sft_stage(cfg, eval_fn=eval_fn)
    assert seen == [2, 4, 6] and result.step == 6  # 0.2, 0.4, then 0.6 >= 0.5
    load_policy(result.final_policy)
    # The run is over: running it again resumes at its end and trains no further.
    again = run_sft_stage(cfg, eval_fn=eval_fn)
    assert again.step == 6 and seen == [2, 4, 6] and list(history(again)) == list(range(1, 7))
    with pytest.raises(ConfigError, match=r"sft.stop_at_pass is a solve rate in \(0, 1\]"):
        sft_config(model_dir, data, tmp_path, "sft.stop_at_pass=50")
    with pytest.raises(ConfigError, match="sft.stop_at_pass needs an evaluation"):
        run_sft_stage(sft_config(model_dir, data, tmp_path / "y", "sft.stop_at_pass=0.5"))


def test_sft_exports_a_policy_every_hf_save_interval_steps_besides_the_final_one(
    model_dir, data, tmp_path
):
    cfg = sft_config(
        model_dir, data, tmp_path,
        "sft.steps=5", "sft.optimizer_config.lr=3e-3", "sft.hf_save_interval=2",
    )  # fmt: skip
    result = run_sft_stage(cfg)
    exports = tmp_path / "runs" / "sft" / "exports"
    assert sorted(p.name for p in exports.glob("global_step_*")) == [
        "global_step_2",
        "global_step_4",
    ]
    early = load_policy(exports / "global_step_2" / "policy")[0]
    final = load_policy(result.final_policy)[0]
    differ = [
        not torch.equal(a, b) for a, b in zip(early.parameters(), final.parameters(), strict=True)
    ]
    assert any(differ)  # a snapshot of step 2, not a copy of the final weights
    with pytest.raises(ConfigError, match="sft.hf_save_interval must be >= 1, or -1"):
        sft_config(model_dir, data, tmp_path, "sft.hf_save_interval=0")


def test_sft_keeps_the_best_evaluated_policy_with_its_step(model_dir, data, tmp_path):
    scores = {1: 0.2, 2: 0.5, 3: 0.5, 4: 0.3}  # the tie at step 3 keeps step 2

    def eval_fn(model, chat, step):
        return {"eval/all/pass_at_1": scores[step]}

    cfg = sft_config(
        model_dir, data, tmp_path,
        "sft.steps=4", "sft.optimizer_config.lr=3e-3", "sft.eval_interval=1",
        "sft.hf_save_interval=1", "sft.export_best=true",
    )  # fmt: skip
    result = run_sft_stage(cfg, eval_fn=eval_fn)
    exports = tmp_path / "runs" / "sft" / "exports"
    record = json.loads((exports / "best" / "best.json").read_text())
    assert record["step"] == 2 and record["eval/all/pass_at_1"] == 0.5
    assert record["policy"] == str(exports / "best" / "policy")
    best, step2, final = (
        load_policy(d)[0]
        for d in (
            exports / "best" / "policy",
            exports / "global_step_2" / "policy",
            result.final_policy,
        )
    )
    assert all(
        torch.equal(a, b) for a, b in zip(best.parameters(), step2.parameters(), strict=True)
    )
    assert any(
        not torch.equal(a, b) for a, b in zip(best.parameters(), final.parameters(), strict=True)
    )
    with pytest.raises(ConfigError, match="sft.export_best needs an evaluation"):
        run_sft_stage(sft_config(model_dir, data, tmp_path / "n", "sft.export_best=true"))


def test_sigterm_ends_sft_at_that_step_evaluated_saved_and_exported(model_dir, data, tmp_path):
    seen: list[int] = []

    def eval_fn(model, chat, step):
        seen.append(step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"eval/all/pass_at_1": 0.0}

    cfg = sft_config(model_dir, data, tmp_path, "sft.steps=5", "sft.eval_interval=2")
    result = run_sft_stage(cfg, eval_fn=eval_fn)
    # The signal came in step 2's evaluation: step 3 is the one it ends, evaluated as a last step.
    assert result.step == 3 and seen == [2, 3] and list(history(result)) == [1, 2, 3]
    assert (tmp_path / "runs" / "sft" / "ckpts" / "global_step_3").is_dir()
    load_policy(result.final_policy)
    # The same command goes on from there to the end.
    again = run_sft_stage(cfg, eval_fn=eval_fn)
    assert again.step == 5 and seen == [2, 3, 4, 5]
    assert list(history(again)) == [1, 2, 3, 4, 5]


def test_teacher_forced_first_turn_is_what_the_greedy_policy_plays(model_dir, rows, data, tmp_path):
    from clew.inference.engine import InferenceEngine
    from clew.inference.sampling import SamplingParams
    from clew.rollout.loop import RolloutSettings, play
    from clew.trainer.agreement import solver_agreement, solver_predictions

    # A little SFT first, so that the greedy policy writes actions in the format.
    cfg = sft_config(
        model_dir, data, tmp_path,
        "sft.steps=25", "sft.batch_size=4", "sft.optimizer_config.lr=3e-3",
    )  # fmt: skip
    model, processor = load_policy(run_sft_stage(cfg).final_policy)
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
    model_dir, data, tmp_path, monkeypatch
):
    real_backward = torch.Tensor.backward
    calls = {"n": 0}

    def backward_nan_after_two(self, *a, **k):
        calls["n"] += 1
        real_backward(self * float("nan") if calls["n"] > 2 else self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "backward", backward_nan_after_two)
    cfg = sft_config(model_dir, data, tmp_path, "sft.steps=20", "sft.batch_size=2")
    with pytest.raises(ClewError, match=r"NaN or infinite at SFT steps 3-5.* policy of step 2"):
        run_sft_stage(cfg)
    monkeypatch.undo()
    logged = read_history(tmp_path / "runs" / "sft")
    assert [r["sft/skipped"] for r in logged] == [0, 0, 1, 1, 1]
    model, _ = load_policy(tmp_path / "runs" / "sft" / "exports" / "final" / "policy")
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sft.lora.rank=-1", "sft.lora.rank must be >= 0"),
        ("sft.lora.alpha=0.0", "sft.lora.alpha must be > 0"),
        ("sft.optimizer_config.lr=0.0", "sft.optimizer_config.lr must be > 0"),
        ("sft.optimizer_config.num_warmup_steps=-2", "num_warmup_steps must be >= 0"),
        ("sft.detour_prob=1.5", r"sft.detour_prob is a share in \[0, 1\]"),
        ("sft.steps=0", "sft.steps must be >= 1"),
    ],
)
def test_bad_sft_settings_are_refused_by_the_config(model_dir, data, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        sft_config(model_dir, data, tmp_path, override)
