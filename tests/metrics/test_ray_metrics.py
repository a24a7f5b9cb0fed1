"""Training metrics through Ray's metrics API: when the ray logger is on, the names it gives,
a short run on two CPU workers scraped from Ray's Prometheus endpoint on loopback, and the
Grafana dashboard's queries against what that run exported."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest
from envs_for_tests import ray_runtime_env
from support.tiny import digits_data

from clew.config import load_config
from clew.errors import ConfigError
from clew.metrics import (
    CATALOG,
    exported_name,
    make_loggers,
    ray_metric_name,
    with_ray_metrics,
)
from clew.metrics.catalog import MEMORY_PHASES, peak_memory_metric
from clew.metrics.ray_metrics import REPORT_INTERVAL_ENV
from clew.ray_connect import start_local_ray
from clew.trainer.launch import run_grpo

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "clew-dashboard.json"
PROMETHEUS_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
PROJECT, RUN = "obs", "scraped"


def test_metric_names_become_prometheus_names_under_a_clew_prefix():
    assert ray_metric_name("train/solve_rate") == "clew_train_solve_rate"
    assert ray_metric_name("eval/all/pass_at_1") == "clew_eval_all_pass_at_1"
    assert ray_metric_name("train/end_reason/max-turns") == "clew_train_end_reason_max_turns"
    assert exported_name("timing/generate") == "ray_clew_timing_generate"
    for spec in CATALOG:
        assert PROMETHEUS_NAME.match(exported_name(spec.name.replace("<", "").replace(">", "")))


def test_the_ray_logger_is_on_whenever_the_run_uses_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert with_ray_metrics("console", 1) == ["console"]
    assert with_ray_metrics("console", 2) == ["console", "ray"]
    assert with_ray_metrics(["jsonl", "ray"], 2) == ["jsonl", "ray"]
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # a job's driver joins its cluster
    assert with_ray_metrics("console, tensorboard", 1) == ["console", "tensorboard", "ray"]


def test_the_ray_logger_asked_for_by_a_run_without_ray_fails_before_any_model_loads(
    monkeypatch, tmp_path
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(
        None,
        [
            f"data.train_data=['{tmp_path / 'missing.parquet'}']",
            "trainer.policy.model.path=/nonexistent",
            "trainer.logger=[console,ray]",
        ],
    )
    with pytest.raises(ConfigError) as err:
        run_grpo(cfg)  # would fail reading the data or the model after this check
    message = str(err.value)
    assert "does not use Ray" in message and "num_cpu_workers" in message
    assert "RAY_ADDRESS" in message


def test_the_ray_logger_built_without_ray_running_or_a_cluster_to_join_says_so(
    monkeypatch, tmp_path
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="does not use Ray"):
        make_loggers(["ray"], tmp_path, "p", "r")


# -- a short run on Ray, scraped ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_with_metrics():
    """Ray on loopback for this module, serving its metrics at a known port every second."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("prometheus_client")  # the scrapes' parser, installed with ray[default]
    saved = os.environ.get(REPORT_INTERVAL_ENV)
    # Ray's exporter reports every 10 s by default; 1 s (its floor) keeps the test short.
    os.environ[REPORT_INTERVAL_ENV] = "1000"
    port = _free_port()
    # A Ray of the module's own on loopback, whatever cluster the machine has or had.
    start_local_ray(
        2, log_to_driver=False, runtime_env=ray_runtime_env(), _metrics_export_port=port
    )
    try:
        yield port
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop(REPORT_INTERVAL_ENV, None)
        else:
            os.environ[REPORT_INTERVAL_ENV] = saved


def _scrape(port: int) -> dict[str, dict[float, dict[str, str]]]:
    """clew's series at Ray's endpoint: name -> value -> labels, this test's run only."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    # Ray's own series are most of the text: parsing only clew's keeps the poll cheap.
    text = "\n".join(line for line in text.splitlines() if "ray_clew_" in line) + "\n"
    out: dict[str, dict[float, dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_clew_") and sample.labels.get("run") == RUN:
                out.setdefault(sample.name, {})[sample.value] = sample.labels
    return out


@pytest.fixture(scope="module")
def scraped(ray_with_metrics, tmp_path_factory, one_thread, digits_model_dir):
    """A 2-step GRPO run on two CPU workers, its endpoint scraped while it runs and just after:
    (the run's history, every value seen per series)."""
    root = tmp_path_factory.mktemp("obs")
    cfg = load_config(
        None,
        [
            f"data.train_data=['{digits_data(8)}']",
            f"data.val_data=['{digits_data(3, 'eval')}']",
            f"trainer.policy.model.path={digits_model_dir}",
            f"trainer.log_path={root / 'runs'}",
            f"trainer.project_name={PROJECT}",
            f"trainer.run_name={RUN}",
            "trainer.logger=jsonl",  # ray comes by itself: the run has two workers
            "trainer.placement.num_cpu_workers=2",
            "trainer.eval_before_train=false",
            "trainer.max_steps=2",
            "trainer.eval_interval=2",
            "trainer.ckpt_interval=1",  # step 2 reports step 1's checkpoint time
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=2",
            "trainer.micro_train_batch_size_per_gpu=1",
            "trainer.max_prompt_length=128",
            "trainer.policy.model.lora.rank=4",
            "generator.n_samples_per_prompt=2",
            "generator.max_turns=1",
            "generator.sampling_params.max_generate_length=4",
            "generator.eval_sampling_params.max_generate_length=4",
            "generator.max_input_length=256",
        ],
    )
    failed: list[BaseException] = []

    def run() -> None:
        try:
            run_grpo(cfg)
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    seen: dict[str, dict[float, dict[str, str]]] = {}
    ended = None
    # Values show within a report interval of being set, and the last ones stay for two
    # intervals after the run closes its loggers.
    while ended is None or time.monotonic() - ended < 2.5:
        for name, values in _scrape(ray_with_metrics).items():
            seen.setdefault(name, {}).update(values)
        if ended is None and not thread.is_alive():
            ended = time.monotonic()
        time.sleep(0.2)
    thread.join()
    if failed:
        raise failed[0]
    lines = (root / "runs" / RUN / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], seen


@pytest.mark.ray
def test_a_run_on_ray_exports_its_metrics_to_prometheus_with_the_runs_values(scraped):
    history, seen = scraped
    assert [h["step"] for h in history] == [1, 2]
    logged = {name for h in history for name in h}
    missing = sorted(n for n in logged if exported_name(n) not in seen)
    assert not missing, f"not exported: {missing}"
    # The last step's values stay until the run ends, so the scrapes caught every one.
    final = history[-1]
    for name, value in final.items():
        values = list(seen[exported_name(name)])
        assert any(v == pytest.approx(value, rel=1e-9) for v in values), (name, value, values)
    assert 2.0 in seen["ray_clew_step"] and "eval/all/pass_at_1" in final
    assert final["timing/checkpoint"] > 0 and final["throughput/generated_tokens_per_s"] > 0
    assert list(seen["ray_clew_train_restarts"]) == [0.0]
    labels = seen["ray_clew_train_solve_rate"][final["train/solve_rate"]]
    assert labels["project"] == PROJECT and labels["run"] == RUN


@pytest.mark.ray
def test_a_workers_peak_memory_is_read_in_its_process_and_is_none_without_a_gpu(
    ray_with_metrics,
):
    import ray

    from clew.cluster.ray_group import _worker_peak

    class Worker:
        pass

    worker = ray.remote(Worker).options(num_cpus=0, num_gpus=0).remote()
    try:  # the path RayWorkerGroup.peak_memory_gb takes on GPU workers, here on none
        assert ray.get(worker.__ray_call__.remote(_worker_peak), timeout=300) is None
    finally:
        ray.kill(worker)


# -- the Grafana dashboard -----------------------------------------------------------------


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out += [panel] + panel.get("panels", [])
    return [p for p in out if p.get("type") != "row"]


@pytest.mark.ray
def test_the_grafana_dashboard_queries_only_series_the_ray_logger_exports(scraped):
    history, seen = scraped
    dashboard = json.loads(DASHBOARD.read_text())
    # GPU memory is measured on CUDA only; its names come from the same functions.
    exported = set(seen) | {exported_name(peak_memory_metric(p)) for p in MEMORY_PHASES}
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(dashboard)
    assert panels
    queried = set()
    for panel in panels:
        sources = [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]
        assert all(s["uid"] == "${datasource}" for s in sources), panel["title"]
        exprs = [t["expr"] for t in panel["targets"]]
        names = {n for e in exprs for n in re.findall(r"\bray_clew_[a-zA-Z0-9_]+", e)}
        assert names, f"panel {panel['title']!r} queries no clew series"
        assert names <= exported, f"{panel['title']!r}: {sorted(names - exported)} not exported"
        queried |= names
    wanted = ["train/solve_rate", "eval/all/pass_at_1", "train/reward_mean", "timing/update"]
    wanted += ["throughput/generated_tokens_per_s", "train/restarts"]
    wanted += [peak_memory_metric("update")]
    assert {exported_name(n) for n in wanted} <= queried
    for name in ("project", "run"):  # the variables the queries filter on
        assert name in variables and "label_values" in variables[name]["query"]["query"]
