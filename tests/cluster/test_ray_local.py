"""The embedded Ray and what a run on it refuses to do: a Ray of its own whatever cluster file
the machine has left behind, every listener on loopback, SkyRL's placement timeout, workers
named by run and rank that draw no progress bars, env ids resolved in every worker before
the first step, and a step whose every episode failed with an env error stopping the run.

One Ray instance for the module, started as ``clew train`` starts it (``connect_ray``) with
``RAY_TMPDIR`` pointing at a folder that holds a stale ``ray_current_cluster`` file: the
machine's own ``/tmp/ray`` is neither read nor written.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from envs_for_tests import DigitsEnv, digits_rows

from clew.cli import main
from clew.cluster.placement import worker_placement_group
from clew.cluster.ray_group import RayWorkerGroup
from clew.config import load_config
from clew.data.rows import write_rows
from clew.envs import base as env_base
from clew.envs import register
from clew.errors import ClewError, EnvError
from clew.ray_connect import connect_ray
from clew.train.settings import WorkerSettings
from clew.trainer.launch import placement_settings, run_grpo

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_thread")]

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
BARS = ("Loading weights", "Writing model shards", "it/s]")


def _dead_address() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def embedded() -> Iterator[dict]:
    """``connect_ray(2)`` as ``clew train`` calls it, under a ``RAY_TMPDIR`` whose
    ``ray/ray_current_cluster`` names a cluster that is gone (a `ray start` head stopped by
    a signal leaves that). What it returned, the stale address and the temp folder."""
    ray = pytest.importorskip("ray")
    temp = Path(tempfile.mkdtemp(prefix="clewray", dir="/tmp"))  # short: Unix socket paths
    (temp / "ray").mkdir()
    stale = _dead_address()
    (temp / "ray" / "ray_current_cluster").write_text(stale)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TMPDIR", str(temp))
        mp.delenv("RAY_ADDRESS", raising=False)
        try:
            started = connect_ray(2)
            yield {"started": started, "stale": stale, "temp": temp}
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def group(embedded, digits_model_dir) -> Iterator[RayWorkerGroup]:
    """Two full-weight workers named ``clew-fixture-worker-<rank>``, holding no CPU of the
    instance (the runs below take both)."""
    g = RayWorkerGroup(
        digits_model_dir,
        WorkerSettings(),
        2,
        num_cpus_per_worker=0,
        name="clew-fixture",
        strategy="ddp",
    )
    yield g
    g.shutdown()


def _config(tmp_path: Path, model: Path, rows: list, *overrides: str):
    write_rows(rows, tmp_path / "train.parquet")
    return [
        f"data.train_data=['{tmp_path / 'train.parquet'}']",
        f"trainer.policy.model.path={model}",
        f"trainer.log_path={tmp_path / 'runs'}",
        "trainer.run_name=local",
        "trainer.logger=jsonl",
        "trainer.eval_before_train=false",
        "trainer.max_steps=1",
        "trainer.ckpt_interval=-1",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "trainer.max_prompt_length=128",
        "trainer.policy.model.lora.rank=4",
        "trainer.placement.num_cpu_workers=2",
        "generator.n_samples_per_prompt=2",
        "generator.max_turns=1",
        "generator.sampling_params.max_generate_length=4",
        "generator.max_input_length=256",
        *overrides,
    ]


def test_clew_trains_on_a_ray_of_its_own_whatever_a_stale_cluster_file_names(embedded):
    ray = pytest.importorskip("ray")
    assert embedded["started"]
    assert ray.cluster_resources()["CPU"] == 2  # the CPUs asked, on a new instance
    assert ray.get_runtime_context().gcs_address != embedded["stale"]
    assert (embedded["temp"] / "ray" / "ray_current_cluster").read_text() == embedded["stale"]


def test_every_listener_of_the_embedded_ray_is_on_loopback(embedded, group):
    psutil = pytest.importorskip("psutil")
    ray = pytest.importorskip("ray")
    me = psutil.Process()
    listening: dict[str, set[tuple[str, int]]] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            name = proc.name() if proc.pid != me.pid else "driver"
            if name != "driver" and "ray" not in f"{name} {' '.join(proc.cmdline())}":
                continue  # not one of Ray's processes
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listening.setdefault(name, set()).add((c.laddr.ip, c.laddr.port))
        except psutil.Error:  # a process that ended meanwhile
            continue
    assert {"driver", "gcs_server", "raylet"} <= set(listening), sorted(listening)
    assert any("DataParallelWorker" in n for n in listening), sorted(listening)
    open_wide = {n: a for n, a in listening.items() if any(ip not in LOOPBACK for ip, _ in a)}
    assert not open_wide, open_wide
    metrics_port = ray._private.worker._global_node.metrics_export_port
    assert any(port == metrics_port for a in listening.values() for _, port in a)


def test_workers_a_busy_instance_cannot_place_wait_skyrls_timeout_when_the_key_is_unset(
    embedded, monkeypatch
):
    ray = pytest.importorskip("ray")
    from ray.util.placement_group import placement_group, remove_placement_group

    hold = placement_group([{"CPU": 1}])  # another job's: one of the 2 CPUs taken
    ray.get(hold.ready())
    monkeypatch.setenv("SKYRL_RAY_PG_TIMEOUT_IN_S", "1")
    pl = load_config(None, ["trainer.placement.num_cpu_workers=2"]).trainer.placement
    try:
        with pytest.raises(ClewError, match=r"within SKYRL_RAY_PG_TIMEOUT_IN_S .* = 1 s.*1 free"):
            worker_placement_group(placement_settings(pl), on_gpus=False)
    finally:
        remove_placement_group(hold)


def test_worker_actors_are_named_by_run_and_rank_and_a_name_in_use_is_refused(
    group, digits_model_dir
):
    ray = pytest.importorskip("ray")
    for rank in range(2):
        actor = ray.get_actor(f"clew-fixture-worker-{rank}")
        assert ray.get(actor.ready.remote()) == rank
    with pytest.raises(ClewError, match=r"'clew-fixture-worker-0'.*another live run.*run_name"):
        RayWorkerGroup(
            digits_model_dir, WorkerSettings(), 2, num_cpus_per_worker=0, name="clew-fixture"
        )
    assert ray.get(ray.get_actor("clew-fixture-worker-0").ready.remote()) == 0  # untouched


def test_workers_draw_no_progress_bars_in_their_logs(embedded, group, tmp_path):
    group.export(tmp_path / "export")  # full weights: transformers' "Writing model shards"
    assert list((tmp_path / "export").glob("*.safetensors"))
    logs = sorted((embedded["temp"] / "ray" / "session_latest" / "logs").glob("worker-*.err"))
    assert logs  # the workers' own stderr files
    text = "".join(p.read_text(errors="replace") for p in logs)
    assert not [b for b in BARS if b in text]


def test_an_env_id_known_only_to_the_driver_stops_the_run_before_its_first_step(
    embedded, digits_model_dir, tmp_path, monkeypatch
):
    # Registered in this process only, as a script's own register() call does (in a copy of
    # the registry: the later tests of this process see the registry they had).
    monkeypatch.setattr(env_base, "_REGISTRY", dict(env_base._REGISTRY))
    register("driver_only/digits", DigitsEnv, accepted_options=set())
    named: list[list[str]] = []
    check = getattr(RayWorkerGroup, "check_envs", None)

    def recording(self, env_ids):  # the names of the group the run built
        named.append(list(getattr(self, "names", [])))
        return check(self, env_ids)

    monkeypatch.setattr(RayWorkerGroup, "check_envs", recording, raising=False)
    rows = [dataclasses.replace(r, env_id="driver_only/digits") for r in digits_rows(4)]
    cfg = load_config(None, _config(tmp_path, digits_model_dir, rows))
    with pytest.raises(EnvError) as err:
        run_grpo(cfg)
    message = str(err.value)
    assert "'driver_only/digits'" in message and "Ray worker 0 of 2" in message
    assert "environment.modules" in message and "'clew.envs'" in message
    assert named == [["clew-local-worker-0", "clew-local-worker-1"]]  # the run's own names
    assert not (tmp_path / "runs" / "local" / "metrics.jsonl").exists()  # no step taken


BROKEN_ENVS = """
from PIL import Image

from clew.envs import register
from clew.envs.base import Observation


class SimulatorDown:
    max_turns = 1

    def __init__(self, **options):
        self.done = False

    def reset(self, seed):
        return Observation([Image.new("RGB", (28, 28))], "Write digits.")

    def step(self, text):
        raise RuntimeError("the simulator is down")


register("broken/simulator", SimulatorDown, accepted_options=set())
"""


def test_a_step_whose_every_episode_failed_with_an_env_error_stops_non_zero(
    embedded, digits_model_dir, tmp_path, monkeypatch, capsys, request
):
    (tmp_path / "broken_envs.py").write_text(BROKEN_ENVS)
    monkeypatch.chdir(tmp_path)  # the workers import it from here (environment.modules)
    # The driver imports it too: into a copy of the registry, so that the later tests of this
    # process never meet the broken env (``text_corpus`` steps every registered env).
    monkeypatch.setattr(env_base, "_REGISTRY", dict(env_base._REGISTRY))
    request.addfinalizer(lambda: sys.modules.pop("broken_envs", None))
    rows = [dataclasses.replace(r, env_id="broken/simulator") for r in digits_rows(4)]
    args = _config(tmp_path, digits_model_dir, rows, "environment.modules=[broken_envs]")
    code = main(["train", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "every one of the 4 episodes of step 1 generate failed with an env error" in err, err
    assert "RuntimeError: the simulator is down" in err and "'broken/simulator'" in err, err
    assert not (tmp_path / "runs" / "local" / "exports").exists()  # nothing was learned


def test_clew_train_with_an_env_id_registered_nowhere_exits_non_zero_naming_it(
    embedded, digits_model_dir, tmp_path
):
    rows = [dataclasses.replace(r, env_id="nowhere/maze") for r in digits_rows(2)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-m", "clew", "train", *_config(tmp_path, digits_model_dir, rows)],
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "environment id 'nowhere/maze' of the run's data is not registered" in done.stderr
    assert "environment.modules" in done.stderr and "'clew.envs'" in done.stderr
    assert "Traceback" not in done.stderr and "Started a local Ray" not in done.stderr
    assert not (tmp_path / "runs" / "local" / "metrics.jsonl").exists()
