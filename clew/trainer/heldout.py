"""The pipeline's 'test' stage: GRPO's policies played on a held-out set of other mazes.

The fixed eval set GRPO evaluates on is small (64 mazes in the recipes), and GRPO keeps its
best step by that set, so its figures are both noisy and chosen on it. The 'test' stage
draws ``pipeline.test.rows`` more eval-split rows from ``pipeline.test.seed_start`` on, of
the 'dataset' stage's env id and eval options (the eval set's distribution), each a
distinct task that is none of the eval set's or the selection set's (``data.select_data``,
which picked the best policy; ``generate_rows(exclude=...)``), and plays
them with GRPO's own evaluation settings (``rollout_settings(cfg, evaluation=True)``, the
engine options of GRPO's engine, GRPO's seed and precision) under three policies:

* ``start``: GRPO's starting policy (``trainer.policy.model.path``), step 0;
* ``final``: GRPO's newest export, ``export_path/global_step_<N>/policy``;
* ``best``: ``export_path/best/policy`` (``best.json`` gives its step and the metric that
  picked it), when it is neither of the others.

An export of a LoRA run is the adapter (``adapter_config.json``) over the starting policy,
loaded as `clew eval --model START --adapter EXPORT` loads it; a full-weight export is a
checkpoint of its own. Each policy's evaluation lands in ``LOG/test/<name>/``
(``metrics.json``, ``trajectories.jsonl``, ``gifs/``), the rows in
``LOG/data/test.parquet`` and the figures in ``LOG/test.json``.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clew.checkpoint.layout import parse_step
from clew.config import ClewConfig
from clew.data.rows import Row
from clew.errors import ClewError
from clew.trainer.pipeline import grpo_exports
from clew.trainer.stage_records import write_json

TEST_FILE = "test.json"
ROWS_FILE = Path("data") / "test.parquet"
# What each policy's entry of test.json keeps of its evaluation's metrics.
FIGURES = {
    "solve_rate": "eval/all/solve_rate",
    "reward_pass_at_1": "eval/all/reward_pass_at_1",
    "episodes": "eval/all/episodes",
}


@dataclass(frozen=True)
class EvaluatedPolicy:
    """One policy the stage evaluates: its name in test.json, its folder and GRPO step."""

    name: str
    path: str
    step: int


def export_path(cfg: ClewConfig) -> Path:
    """Where the GRPO run of ``cfg`` exports its policies (a local folder)."""
    path = grpo_exports(cfg)
    if "://" in path:
        raise ClewError(
            f"the 'test' stage reads GRPO's exports from a local folder; trainer.export_path "
            f"is {path}. Drop 'test' from pipeline.stages, or export to a local path"
        )
    return Path(path)


def _exported(folder: Path) -> bool:
    """Whether ``folder`` holds a whole export: an adapter or a full-weight checkpoint."""
    return (folder / "adapter_config.json").is_file() or (folder / "config.json").is_file()


def grpo_policies(cfg: ClewConfig) -> list[EvaluatedPolicy]:
    """GRPO's start, its newest export and, when it is another step, its best export."""
    exports = export_path(cfg)
    steps = {
        step: p / "policy"
        for p in (exports.iterdir() if exports.is_dir() else ())
        if (step := parse_step(p.name)) is not None and _exported(p / "policy")
    }
    if not steps:
        raise ClewError(
            f"the 'test' stage found no exported GRPO policy (global_step_N/policy) in "
            f"{exports}: it evaluates what the 'train' stage exported"
        )
    final_step = max(steps)
    policies = [
        EvaluatedPolicy("start", str(cfg.trainer.policy.model.path), 0),
        EvaluatedPolicy("final", str(steps[final_step]), final_step),
    ]
    best, record = exports / "best" / "policy", exports / "best" / "best.json"
    if _exported(best) and record.is_file():
        step = int(json.loads(record.read_text())["step"])
        # The best at step 0 is the start, at the final step the final: evaluated already.
        if step not in (0, final_step):
            policies.append(EvaluatedPolicy("best", str(best), step))
    return policies


def evaluated(results: dict[str, Any]) -> list[EvaluatedPolicy]:
    """The policies a test.json holds figures of."""
    return [EvaluatedPolicy(name, r["policy"], r["step"]) for name, r in results.items()]


def read_results(out: Path) -> dict[str, Any] | None:
    """LOG/test.json, or None where there is none."""
    path = out / TEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def depends_on(cfg: ClewConfig) -> dict[str, Any]:
    """The config keys, besides ``pipeline.test``, the stage's rows and figures follow."""
    d, g, t = cfg.pipeline.dataset, cfg.generator, cfg.trainer
    # Named only when set, so a record made before the selection set existed still matches.
    select = {"data.select_data": list(cfg.data.select_data)} if cfg.data.select_data else {}
    return select | {
        "pipeline.dataset.env_id": d.env_id,
        "pipeline.dataset.env_options": dict(d.env_options),
        "pipeline.dataset.eval_env_options": dict(d.eval_env_options),
        "data.val_data": list(cfg.data.val_data),
        "trainer.policy.model.path": t.policy.model.path,
        "trainer.seed": t.seed,
        "trainer.bf16": t.bf16,
        "generator.eval_sampling_params": g.eval_sampling_params.model_dump(mode="json"),
        "generator.eval_n_samples_per_prompt": g.eval_n_samples_per_prompt,
        "generator.max_turns": g.max_turns,
        "generator.max_input_length": g.max_input_length,
        "generator.keep_last_k_images": g.keep_last_k_images,
        "generator.reply_prefix": g.reply_prefix,
        "generator.reply_suffix": g.reply_suffix,
        "environment.reward_rule": cfg.environment.reward_rule,
        "environment.prompt_format": cfg.environment.prompt_format,
    }


def held_out_rows(cfg: ClewConfig) -> list[Row]:
    """``pipeline.test.rows`` eval-split rows of distinct tasks, none an eval row's task or
    a selection row's."""
    from clew.data.rows import generate_rows, read_rows

    d, t = cfg.pipeline.dataset, cfg.pipeline.test
    used = [r for p in [*cfg.data.val_data, *cfg.data.select_data] for r in read_rows(p)]
    return generate_rows(
        d.env_id,
        t.rows,
        "eval",
        seed_start=t.seed_start,
        env_options=dict(d.env_options) | dict(d.eval_env_options),
        distinct=True,
        exclude=used,
    )


def run_test(
    cfg: ClewConfig, out: Path, policies: list[EvaluatedPolicy], say: Callable[[str], None]
) -> dict[str, Any]:
    """Writes LOG/data/test.parquet, evaluates each of ``policies`` on it into
    LOG/test/<name>/ and writes their figures to LOG/test.json, which it returns."""
    from clew.config.settings import rollout_settings
    from clew.data.rows import dataset_stats, format_stats, with_env_option, write_rows
    from clew.inference.runtime import limit_host_threads, pick_device
    from clew.rollout.evaluation import evaluate, headline

    rows = held_out_rows(cfg)
    write_rows(rows, out / ROWS_FILE)
    say(f"test set: {out / ROWS_FILE}\n{format_stats(dataset_stats(rows))}")
    if (fmt := cfg.environment.prompt_format) is not None:  # as GRPO plays its eval rows
        rows = with_env_option(rows, "prompt_format", fmt)
    settings = rollout_settings(cfg, evaluation=True)
    device = pick_device(cfg.trainer.device)
    limit_host_threads(device)
    results: dict[str, Any] = {}
    for policy in policies:
        _free(device)  # what the run before (GRPO, or the policy before) left in memory
        engine = _engine(cfg, policy, device)
        if settings.sampling.allowed_tokens:  # a text that is not one token fails here
            engine.allowed_ids(settings.sampling.allowed_tokens)
        metrics, _ = evaluate(
            engine, rows, settings, output_dir=out / "test" / policy.name, seed=cfg.trainer.seed
        )
        del engine  # it holds the model, freed before the next policy loads
        say(
            f"test: {policy.name} (step {policy.step}) on {len(rows)} held-out mazes: "
            + headline(metrics)
        )
        results[policy.name] = {"policy": policy.path, "step": policy.step} | {
            key: metrics[name] for key, name in FIGURES.items()
        }
    _free(device)
    write_json(out / TEST_FILE, results)
    return results


def _free(device: Any) -> None:
    """Collect unreferenced objects and, on CUDA, hand their cached memory back."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _engine(cfg: ClewConfig, policy: EvaluatedPolicy, device: Any) -> Any:
    """The inference engine of ``policy`` as GRPO builds its own: the same weights' dtype
    and autocast (``trainer.bf16``, LoRA) and ``generator.inference_engine``'s options. An
    adapter export loads over GRPO's starting policy."""
    from clew.config.settings import engine_options
    from clew.models import load_policy
    from clew.models.adapter_loading import load_adapter
    from clew.models.chat import ChatFormat
    from clew.models.precision import policy_precision

    t = cfg.trainer
    precision = "bf16-mixed" if t.bf16 else "32-true"
    dtype, autocast = policy_precision(device, precision, t.policy.model.lora.rank > 0)
    adapter = (Path(policy.path) / "adapter_config.json").is_file()
    model, processor = load_policy(
        t.policy.model.path if adapter else policy.path, dtype=dtype, device=device
    )
    if adapter:
        model = load_adapter(model, policy.path)
    model.eval()
    return engine_options(cfg).build(model, ChatFormat(processor), autocast=autocast)


def summary_figures(out: Path) -> dict[str, Any]:
    """The held-out figures of summary.json, from LOG/test.json and LOG/data/test.parquet:
    ``test_rows`` and, per evaluated policy, ``test_<name>_solve_rate`` and
    ``test_<name>_reward_pass_at_1``; empty where the stage left no figures."""
    import pyarrow.parquet as pq

    results = read_results(out)
    if results is None:
        return {}
    figures: dict[str, Any] = {"test_rows": pq.read_metadata(out / ROWS_FILE).num_rows}
    for name, r in results.items():
        figures[f"test_{name}_solve_rate"] = r["solve_rate"]
        figures[f"test_{name}_reward_pass_at_1"] = r["reward_pass_at_1"]
    return figures


def describe(out: Path) -> str:
    """One line of LOG/test.json's solve rates, each policy's with its step."""
    import pyarrow.parquet as pq

    results, rows = read_results(out) or {}, pq.read_metadata(out / ROWS_FILE).num_rows
    rates = ", ".join(
        f"{name} {r['solve_rate']:.1%} (step {r['step']})" for name, r in results.items()
    )
    return f"solve rate on {rows} held-out mazes: {rates}"
