"""`clew train` submitted as a Ray job to a running cluster with token authentication on:
`ray start --head` on loopback, `ray job submit`, the run's metrics and exports, and
`ray job stop` as a graceful stop (checkpoint, export, exit)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.tiny import env_data, tiny_policy

pytestmark = pytest.mark.ray  # about 45 s on 2 CPUs: in the default suite

RAY = Path(sys.executable).with_name("ray")
MAZE = {"cell_px": 28, "action_format": "keyword"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Head:
    address: str  # the dashboard's job API
    env: dict[str, str]  # what a client needs: token mode and the token file

    def ray(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [str(RAY), *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"ray {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    def submit(self, working_dir: Path, *train_args: str) -> str:
        # Ray kills a stopped job 3 s after its SIGTERM unless told to wait longer: the
        # step in progress, the checkpoint and the export need that time.
        runtime_env = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "300"}})
        out = self.ray(
            "job", "submit", "--address", self.address, "--working-dir", str(working_dir),
            "--runtime-env-json", runtime_env, "--no-wait", "--",
            sys.executable, "-m", "clew", "train", *train_args,
        )  # fmt: skip
        found = re.search(r"(raysubmit_\w+)", out)
        assert found, out
        return found.group(1)

    def status(self, job: str) -> str:
        out = self.ray("job", "status", "--address", self.address, job)
        found = re.search(r"Status for job '[^']+': (\w+)", out)
        ended = re.search(r"Job '[^']+' (?:was )?(succeeded|failed|stopped)", out)
        assert found or ended, out
        return found.group(1) if found else ended.group(1).upper()

    def wait(self, job: str, timeout: float = 300) -> str:
        deadline = time.time() + timeout
        while (state := self.status(job)) in ("PENDING", "RUNNING"):
            assert time.time() < deadline, f"{job} still {state}"
            time.sleep(2)
        return state

    def logs(self, job: str) -> str:
        return self.ray("job", "logs", "--address", self.address, job)


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    """A Ray head on loopback with token auth and the dashboard, stopped by its own pid.

    `ray stop` would stop every Ray instance of this user on the machine, so the head runs
    with --block in its own temp dir and is ended through that process alone.
    """
    if not RAY.exists():
        pytest.skip("the ray CLI is not installed")
    temp = Path(tempfile.mkdtemp(prefix="clewray", dir="/tmp"))  # short: Unix socket paths
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every listener on 127.0.0.1
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RAY_ADDRESS", None)
    dashboard = _free_port()
    started = time.time()
    proc = subprocess.Popen(
        [
            str(RAY),
            "start",
            "--head",
            "--block",
            f"--port={_free_port()}",
            "--num-cpus=2",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--temp-dir={temp / 'ray'}",
        ],  # fmt: skip
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        client = Head(f"http://127.0.0.1:{dashboard}", env)
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, "ray start --head exited"
            listed = subprocess.run(
                [str(RAY), "job", "list", "--address", client.address],
                env=env, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if listed.returncode == 0:
                break
            assert time.time() < deadline, listed.stderr
            time.sleep(1)
        print(f"head up in {time.time() - started:.1f}s")
        yield client
    finally:
        stopping = time.time()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        print(f"head stopped in {time.time() - stopping:.1f}s")
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The job's working directory and the folder of its runs (the policy and rows:
    ``support.tiny``)."""
    root = tmp_path_factory.mktemp("job")
    (root / "workdir").mkdir()
    (root / "workdir" / "README").write_text("the job's working directory\n")
    return root


def _train_args(root: Path, run: str, *extra: str) -> list[str]:
    return [
        f"data.train_data=['{env_data('maze_2d/tiny', 16, env_options=MAZE)}']",
        f"trainer.policy.model.path={tiny_policy(image_size=140)}",
        f"trainer.log_path={root / 'runs'}",
        f"trainer.ckpt_path={root / 'ckpts' / run}",
        f"trainer.run_name={run}",
        "trainer.logger=jsonl",
        "trainer.eval_before_train=false",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "trainer.micro_train_batch_size_per_gpu=1",
        "trainer.max_prompt_length=512",
        "trainer.policy.model.lora.rank=4",
        "generator.n_samples_per_prompt=2",
        "generator.max_turns=2",
        "generator.sampling_params.max_generate_length=4",
        "generator.max_input_length=1024",
        *extra,
    ]


def _history(root: Path, run: str) -> list[dict]:
    lines = (root / "runs" / run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_submitted_train_job_on_two_workers_succeeds_with_metrics_and_an_export(head, files):
    started = time.time()
    job = head.submit(
        files / "workdir",
        *_train_args(files, "job", "trainer.max_steps=2", "trainer.ckpt_interval=2"),
        "trainer.placement.num_cpu_workers=2",
    )
    submitted = time.time()
    state = head.wait(job)
    logs = head.logs(job)
    print(f"submit {submitted - started:.1f}s, run to {state} {time.time() - submitted:.1f}s")
    assert state == "SUCCEEDED", logs
    trained = [h for h in _history(files, "job") if "policy/optimizer_steps" in h]
    assert [h["step"] for h in trained] == [1, 2], trained
    assert (files / "ckpts" / "job" / "global_step_2").is_dir()
    assert (files / "runs" / "job" / "exports" / "global_step_2" / "policy").is_dir()
    assert job in head.ray("job", "list", "--address", head.address)


def test_ray_job_stop_ends_a_run_gracefully_with_a_checkpoint_and_an_export(head, files):
    job = head.submit(
        files / "workdir",
        *_train_args(
            files,
            "stopped",
            "trainer.max_steps=200",
            "trainer.epochs=25",
            "trainer.ckpt_interval=1",
        ),
    )
    ckpts = files / "ckpts" / "stopped"
    deadline = time.time() + 300
    while not (ckpts.is_dir() and any(ckpts.glob("global_step_*"))):
        assert head.status(job) in ("PENDING", "RUNNING"), head.logs(job)
        assert time.time() < deadline, head.logs(job)
        time.sleep(1)
    head.ray("job", "stop", "--address", head.address, job)
    state = head.wait(job)
    logs = head.logs(job)
    assert state == "STOPPED", logs
    stopped = re.search(r"stopped by SIGTERM after step (\d+)", logs)
    assert stopped, logs
    step = int(stopped.group(1))
    assert 1 <= step < 200
    assert (ckpts / f"global_step_{step}").is_dir()
    exports = sorted(p.name for p in (files / "runs" / "stopped" / "exports").iterdir())
    assert exports == [f"global_step_{step}"], (exports, logs)
