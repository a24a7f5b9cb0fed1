"""Full checkpoints: kill -9 and resume gives the same run, bad checkpoints are handled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from envs_for_tests import digits_rows
from support.s3_server import s3_bucket, s3_endpoint  # noqa: F401
from support.tiny import digits_data, digits_policy

from clew.checkpoint.layout import POINTER_FILE
from clew.config import load_config
from clew.errors import CheckpointError
from clew.trainer.launch import build_worker_group, run_grpo

TESTS = Path(__file__).parents[1]
STEPS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The module's folder for runs and checkpoints (the policy and rows: ``support.tiny``)."""
    return tmp_path_factory.mktemp("resume")


def _train_data() -> Path:
    return digits_data(4 * STEPS)


def _overrides(root: Path, run: str, ckpt: str, *extra: str) -> list[str]:
    return [
        f"data.train_data=['{_train_data()}']",
        f"trainer.policy.model.path={digits_policy()}",
        f"trainer.log_path={root / 'runs'}",
        f"trainer.run_name={run}",
        f"trainer.ckpt_path={ckpt}",
        "trainer.logger=jsonl",
        "trainer.train_batch_size=4",
        "trainer.policy_mini_batch_size=2",
        "trainer.micro_train_batch_size_per_gpu=8",
        "trainer.eval_before_train=false",
        "trainer.ckpt_interval=2",
        "trainer.policy.optimizer_config.lr=3.0e-3",
        "trainer.policy.optimizer_config.num_warmup_steps=3",
        "generator.n_samples_per_prompt=4",
        "generator.max_turns=1",
        "generator.sampling_params.max_generate_length=6",
        "generator.max_input_length=512",
        "trainer.max_prompt_length=128",
        *extra,
    ]


def _launch(overrides: list[str], env: dict[str, str]) -> subprocess.Popen:
    code = "import sys, envs_for_tests; from clew.cli import main; sys.exit(main(['train', *sys.argv[1:]]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, *overrides],
        env={**os.environ, **env, "PYTHONPATH": str(TESTS), "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _history(root: Path, run: str) -> dict[int, dict]:
    lines = (root / "runs" / run / "metrics.jsonl").read_text().splitlines()
    out = {}
    for line in lines:
        rec = json.loads(line)
        out[rec["step"]] = {
            k: v for k, v in rec.items() if not k.startswith(("timing/", "throughput/"))
        }
    return out


def _pointer_exists(ckpt: str, storage_env: dict[str, str]) -> bool:
    if ckpt.startswith("s3://"):
        from clew.checkpoint.storage import Storage

        os.environ.update(storage_env)
        return Storage.for_path(ckpt).exists(f"{ckpt}/{POINTER_FILE}")
    return (Path(ckpt) / POINTER_FILE).exists()


def _kill_and_resume(root: Path, ckpt_of, env: dict[str, str], tag: str) -> None:
    straight, killed = f"{tag}-straight", f"{tag}-killed"
    _run_kill_and_resume(root, ckpt_of, env, straight, killed)


def _run_kill_and_resume(root, ckpt_of, env, straight_name, killed_name) -> None:
    straight = _launch(_overrides(root, straight_name, ckpt_of(straight_name)), env)
    out, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out
    victim = _launch(_overrides(root, killed_name, ckpt_of(killed_name)), env)
    deadline = time.time() + 300
    while not _pointer_exists(ckpt_of(killed_name), env):
        assert victim.poll() is None, victim.stdout.read()
        assert time.time() < deadline
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    resumed = _launch(
        _overrides(root, killed_name, ckpt_of(killed_name), "trainer.resume_mode=latest"), env
    )
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert "resumed from" in out
    a, b = _history(root, straight_name), _history(root, killed_name)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert a[step] == b[step], f"step {step} differs after resume"


def test_kill_after_checkpoint_and_resume_matches_the_uninterrupted_run(setup):
    _kill_and_resume(setup, lambda run: str(setup / "ckpts" / run), {}, "local")


def test_kill_and_resume_matches_with_checkpoints_in_s3(setup, s3_bucket, s3_endpoint):  # noqa: F811
    env = {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    _kill_and_resume(setup, lambda run: f"s3://{s3_bucket}/ckpts/{run}", env, "s3")


def test_sigterm_stops_at_a_step_with_checkpoint_and_export_and_resume_matches(setup):
    # Checkpoints never come due on their own (interval 100): what is saved, the stop saved.
    # Dynamic sampling on: its batch count carries over the resume (trainer state).
    extra = (
        "trainer.algorithm.dynamic_sampling.type=filter",
        "trainer.algorithm.dynamic_sampling.max_sample_batches=3",
        "trainer.epochs=20",
        f"trainer.max_steps={STEPS}",
    )
    straight = _launch(
        _overrides(setup, "term-straight", str(setup / "ckpts" / "term-straight"), *extra), {}
    )
    out, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out
    ckpt = str(setup / "ckpts" / "term")
    args = _overrides(setup, "term", ckpt, "trainer.ckpt_interval=100", *extra)
    victim = _launch(args, {})
    metrics = setup / "runs" / "term" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().strip()):
        assert victim.poll() is None, victim.stdout.read()
        assert time.time() < deadline
        time.sleep(0.05)
    victim.send_signal(signal.SIGTERM)
    out, _ = victim.communicate(timeout=300)
    assert victim.returncode == 0, out
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM")]
    assert stopped, out
    step = int(stopped[0].rsplit(" ", 1)[1])
    assert 1 <= step < STEPS
    assert sorted(_history(setup, "term")) == list(range(1, step + 1))
    assert (Path(ckpt) / f"global_step_{step}").is_dir()
    exports = sorted((setup / "runs" / "term" / "exports").iterdir())
    assert [p.name for p in exports] == [f"global_step_{step}"]
    resumed = _launch([*args, "trainer.resume_mode=latest"], {})
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert f"at global step {step}" in out
    assert (Path(ckpt) / f"global_step_{STEPS}").is_dir()  # the last step, saved at the end
    a, b = _history(setup, "term-straight"), _history(setup, "term")
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for s in a:
        assert a[s] == b[s], f"step {s} differs after the stop and resume"


def _cfg(root: Path, run: str, *extra: str):
    return load_config(None, _overrides(root, run, str(root / "ckpts" / run), *extra))


def test_corrupt_latest_checkpoint_falls_back_with_a_warning(setup):
    run_grpo(_cfg(setup, "corrupt", "trainer.epochs=1"))
    ckpt = setup / "ckpts" / "corrupt"
    assert (ckpt / POINTER_FILE).read_text().strip() == str(STEPS)
    state = ckpt / f"global_step_{STEPS}" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:-100])  # truncated
    cfg = _cfg(setup, "corrupt", "trainer.epochs=2")
    from clew.checkpoint.state import Checkpointer
    from clew.trainer.grpo import GRPOTrainer

    trainer = GRPOTrainer(
        cfg,
        build_worker_group(cfg, 4 * STEPS),
        digits_rows(4 * STEPS),
        [],
        None,
        setup / "runs" / "corrupt",
        None,
    )
    with pytest.warns(UserWarning, match=f"global_step_{STEPS}"):
        step = Checkpointer(cfg, setup / "runs" / "corrupt").maybe_resume(trainer.checkpointed())
    assert step == STEPS - 2


def test_incompatible_checkpoint_is_refused_with_the_differences(setup):
    run_grpo(_cfg(setup, "compat", "trainer.ckpt_interval=6"))
    with pytest.raises(CheckpointError, match="lora.rank: checkpoint 0, this run 4"):
        run_grpo(_cfg(setup, "compat", "trainer.policy.model.lora.rank=4", "trainer.epochs=2"))


def test_resume_path_that_is_not_a_checkpoint_is_refused(setup, tmp_path):
    with pytest.raises(CheckpointError, match="not a clew checkpoint"):
        run_grpo(
            _cfg(
                setup, "badpath", "trainer.resume_mode=from_path", f"trainer.resume_path={tmp_path}"
            )
        )


def test_exported_adapter_loads_with_peft_and_matches_the_trainer(setup):
    from peft import PeftModel

    from clew.checkpoint.state import Checkpointer
    from clew.metrics import make_loggers
    from clew.models import load_policy
    from clew.trainer.grpo import GRPOTrainer

    cfg = _cfg(
        setup,
        "export",
        "trainer.policy.model.lora.rank=8",
        "trainer.ckpt_interval=-1",
        "trainer.policy.optimizer_config.lr=0.05",
    )
    run_dir = setup / "runs" / "export"
    group = build_worker_group(cfg, 4 * STEPS)
    loggers = make_loggers("jsonl", run_dir, "p", "export")
    GRPOTrainer(
        cfg, group, digits_rows(4 * STEPS), [], loggers, run_dir, Checkpointer(cfg, run_dir)
    ).fit()
    policy_dir = run_dir / "exports" / f"global_step_{STEPS}" / "policy"
    assert (policy_dir / "adapter_model.safetensors").is_file()
    assert (policy_dir / "adapter_config.json").is_file()
    assert (policy_dir / "tokenizer.json").is_file()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    base, _ = load_policy(digits_policy())
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(base, str(policy_dir)).eval()(input_ids=ids).logits
        group.worker.model.eval()
        trained = group.worker.model(input_ids=ids).logits
    assert not torch.allclose(loaded, plain, atol=1e-4)  # the adapter learned something
    torch.testing.assert_close(loaded, trained, atol=1e-5, rtol=1e-5)


def test_resuming_with_a_new_learning_rate_warns_that_the_checkpoints_value_goes_on(setup):
    run_grpo(_cfg(setup, "newlr", "trainer.ckpt_interval=6"))
    changed = "trainer.policy.optimizer_config.lr=1.0e-3"
    with pytest.warns(
        UserWarning, match=r"optimizer_config\.lr: checkpoint 0\.003, this run 0\.001"
    ):
        run_grpo(_cfg(setup, "newlr", changed, "trainer.epochs=2"))


def test_best_evaluation_is_exported_with_its_step_and_value(setup):
    cfg = _cfg(
        setup,
        "best",
        f"data.val_data=['{_train_data()}']",
        "trainer.eval_before_train=true",
        "trainer.eval_interval=1",
        "trainer.policy.optimizer_config.lr=0.05",
    )
    run_grpo(cfg)
    history = _history(setup, "best")
    evals = [
        (s, r["eval/all/pass_at_1"])
        for s, r in sorted(history.items())
        if "eval/all/pass_at_1" in r
    ]
    assert [s for s, _ in evals] == list(range(STEPS + 1))  # step 0: before training
    top = max(v for _, v in evals)
    first_top = next(s for s, v in evals if v == top)  # ties keep the earlier step
    best = setup / "runs" / "best" / "exports" / "best"
    record = json.loads((best / "best.json").read_text())
    assert record["step"] == first_top and record["eval/all/pass_at_1"] == pytest.approx(top)
    assert (best / "policy" / "config.json").is_file()
    state = torch.load(
        setup / "ckpts" / "best" / f"global_step_{STEPS}" / "trainer_state.pt", weights_only=False
    )
    # Each stateful object's state under its name; the loop's holds the best step, so a
    # resumed run keeps comparing to it.
    assert sorted(state["objects"]) == ["group", "sampler", "trainer"]
    assert state["objects"]["trainer"]["best_step"] == first_top
    assert state["objects"]["sampler"] == {"epoch": 1, "position": 0}


def test_export_best_off_writes_no_best_policy(setup):
    cfg = _cfg(
        setup,
        "nobest",
        f"data.val_data=['{_train_data()}']",
        "trainer.eval_interval=3",
        "trainer.export_best=false",
    )
    run_grpo(cfg)
    assert not (setup / "runs" / "nobest" / "exports" / "best").exists()


class _Counter:
    """A stateful object the checkpointer knows nothing about."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_checkpointer_saves_and_restores_any_named_stateful_objects(tmp_path):
    from clew.checkpoint.state import Checkpointer

    cfg = load_config(None, [f"trainer.log_path={tmp_path}", "trainer.resume_mode=latest"])
    run_dir = tmp_path / "run"
    Checkpointer(cfg, run_dir).save(7, {"loop": _Counter(3), "data": _Counter(5)})
    loop, data = _Counter(), _Counter()
    assert Checkpointer(cfg, run_dir).maybe_resume({"loop": loop, "data": data}) == 7
    assert (loop.value, data.value) == (3, 5)
    with pytest.raises(CheckpointError, match=r"holds the states of \['data', 'loop'\]"):
        Checkpointer(cfg, run_dir).maybe_resume({"loop": _Counter()})
    # A checkpoint of the other stage in the same folder is refused, not half-restored.
    with pytest.raises(CheckpointError, match="of the grpo stage, not sft"):
        Checkpointer(cfg, run_dir, stage="sft").maybe_resume({"loop": loop, "data": data})
