"""A recipe run end to end: ``clew pipeline`` chains dataset, model, SFT, GRPO and a test.

Each stage reads its section of the one config and hands what it made to the next by
updating the config (``data.train_data``/``val_data``, ``sft.model_path``,
``trainer.policy.model.path``), so the run folder of every stage holds the config it ran
with. Everything lands under ``trainer.log_path`` (LOG)::

    LOG/config.yaml                the pipeline's config as given
    LOG/stages.json                what each finished stage made, and from which settings
    LOG/data/{train,eval}.parquet  the 'dataset' stage, with select.parquet (selection rows,
                                   none an eval row's task) when pipeline.dataset.select_rows
    LOG/models/base/               the 'model' stage: the policy SFT starts from
    LOG/<sft.run_name>/            the SFT run; its exports/final/policy is GRPO's start
    LOG/<trainer.run_name>/        the GRPO run, with report.png
    LOG/data/test.parquet          the 'test' stage: held-out mazes, none an eval maze
    LOG/test/<name>/               GRPO's start, final and best policies played on them
    LOG/test.json                  their solve rates (clew.trainer.heldout)
    LOG/summary.json               eval pass@1 of the start, the end and the best step (the
                                   selection set's pick, where there is one), and the
                                   held-out figures

Re-running the same command after an interruption goes on where it stopped: a stage whose
output is complete and was made from the same settings is skipped
(``clew.trainer.stage_records``), and SFT and GRPO resume from their latest checkpoints
(``trainer.resume_mode=latest``). Output made from other settings is an error naming what
differs; it is never reused or overwritten.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clew.config import ClewConfig, save_config, validate
from clew.config.overrides import build_config
from clew.envs.plugins import import_env_modules
from clew.errors import ConfigError
from clew.trainer.stage_records import (
    finished,
    record,
    section_settings,
    upstream,
    write_json,
)

STAGES: tuple[str, ...] = ("dataset", "model", "sft", "train", "test")
SUMMARY_FILE = "summary.json"
EVAL_KEY = "eval/all/pass_at_1"


def say(msg: str) -> None:
    print(f"[pipeline {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_pipeline(cfg: ClewConfig) -> dict[str, float]:
    """Run ``cfg.pipeline.stages`` in order under ``trainer.log_path``; returns the summary.

    The summary (also ``LOG/summary.json``) is GRPO's: ``sft_pass_at_1`` (its evaluation
    before the first step, i.e. the start's), ``final_pass_at_1``, ``gain_points``,
    ``best_step`` and ``best_pass_at_1`` (the eval pass@1 there); with a selection set
    (``data.select_data``) the best step is the one its pass@1 picked, which
    ``best_select_pass_at_1`` gives. Empty when no 'train' stage ran or it evaluated
    nothing. After a 'test' stage it also holds ``test_rows`` and, per policy the stage
    evaluated (start, final, best), ``test_<name>_solve_rate`` and
    ``test_<name>_reward_pass_at_1``.
    """
    check_stages(cfg)
    import_env_modules(cfg.environment.modules)
    out = Path(cfg.trainer.log_path)
    save_config(cfg, out)
    for stage in cfg.pipeline.stages:
        cfg = _STAGE_FNS[stage](cfg, out)
    if "train" not in cfg.pipeline.stages:
        return {}
    return report(cfg, out)


def check_stages(cfg: ClewConfig) -> None:
    """Every problem of the chain at once, before any stage starts."""
    stages, bad = cfg.pipeline.stages, []
    if not stages:
        bad.append(f"pipeline.stages is empty; name some of {', '.join(STAGES)}")
    if len(set(stages)) != len(stages) or stages != sorted(stages, key=STAGES.index):
        bad.append(
            f"pipeline.stages must name each stage at most once, in the order "
            f"{', '.join(STAGES)}; got {stages}"
        )
    if "sft" in stages and "model" not in stages and not cfg.sft.model_path:
        bad.append("the 'sft' stage without 'model' needs sft.model_path")
    if {"sft", "train"} & set(stages) and "dataset" not in stages and not cfg.data.train_data:
        bad.append("the 'sft' and 'train' stages without 'dataset' need data.train_data")
    if "train" in stages and "sft" not in stages and not cfg.trainer.policy.model.path:
        bad.append("the 'train' stage without 'sft' needs trainer.policy.model.path")
    if "test" in stages and "train" not in stages:
        bad.append(
            "the 'test' stage evaluates GRPO's policies: it needs 'train' in pipeline.stages "
            "(a finished GRPO run resumes at its last step and stops)"
        )
    names = {"sft.run_name": cfg.sft.run_name, "trainer.run_name": cfg.trainer.run_name}
    for key, name in names.items():
        if name in ("data", "models"):
            bad.append(f"{key}={name!r} would share its folder with the pipeline's {name}/")
    if {"sft", "train"} <= set(stages) and cfg.sft.run_name == cfg.trainer.run_name:
        bad.append(
            f"sft.run_name and trainer.run_name are both {cfg.sft.run_name!r}: the SFT and "
            "GRPO runs need folders of their own under trainer.log_path"
        )
    if bad:
        raise ConfigError("pipeline: " + "; ".join(bad))


def updated(cfg: ClewConfig, values: dict[str, Any]) -> ClewConfig:
    """``cfg`` with dotted ``values`` set, validated again as a whole. Keys ``cfg`` left at
    their defaults stay defaults, so those that follow another key (the prefill attention
    follows the KV cache) follow the new values."""
    data = cfg.model_dump(mode="python", exclude_unset=True)
    for key, value in values.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return validate(build_config(data))


# -- the stages ---------------------------------------------------------------------------


def _dataset(cfg: ClewConfig, out: Path) -> ClewConfig:
    """Writes LOG/data/{train,eval}.parquet, and select.parquet with
    pipeline.dataset.select_rows; sets data.train_data, data.val_data (and select_data)."""
    import pyarrow.parquet as pq

    from clew.data.rows import dataset_stats, format_stats, generate_rows, write_rows

    d = cfg.pipeline.dataset
    counts = {"train": d.train_rows, "eval": d.eval_rows}
    if d.select_rows:
        counts["select"] = d.select_rows
    paths = {split: out / "data" / f"{split}.parquet" for split in counts}
    settings = section_settings("pipeline.dataset", d)
    if not d.select_rows:  # so a record made before the selection set existed still matches
        for key in ("select_rows", "select_seed_start"):
            del settings[f"pipeline.dataset.{key}"]
    present = all(p.is_file() for p in paths.values())
    if finished(out, "dataset", settings, str(out / "data"), present) and all(
        pq.read_metadata(p).num_rows == counts[s] for s, p in paths.items()
    ):
        sets = ", ".join(f"{n} {split}" for split, n in counts.items())
        say(f"dataset: the {sets} rows of {d.env_id} are already in {out / 'data'}; skipped")
    else:
        made: dict[str, list] = {}
        for split, n in counts.items():
            options = dict(d.env_options) | (dict(d.eval_env_options) if split != "train" else {})
            if split == "select":  # eval-split tasks none of the eval set's, from other seeds
                first, evals = d.select_seed_start, made["eval"]
                rows = generate_rows(d.env_id, n, "eval", first, options, exclude=evals)
            else:
                rows = generate_rows(d.env_id, n, split, env_options=options)
            made[split] = rows
            write_rows(rows, paths[split])
            say(f"{split} set: {paths[split]}\n{format_stats(dataset_stats(rows))}")
        record(out, "dataset", settings, files={s: str(p) for s, p in paths.items()})
    values = {"data.train_data": [str(paths["train"])], "data.val_data": [str(paths["eval"])]}
    if d.select_rows:
        values["data.select_data"] = [str(paths["select"])]
    return updated(cfg, values)


def frame_side(env_id: str, env_options: dict[str, Any]) -> int:
    """The longest side in px of the environment's first frame."""
    from clew.envs import make

    return max(make(env_id, **env_options).reset(0).images[0].size)


def _model(cfg: ClewConfig, out: Path) -> ClewConfig:
    """Builds LOG/models/base offline (`clew init-model`); sets sft.model_path."""
    from clew.envs.base import text_corpus
    from clew.models import build_model

    m, d = cfg.pipeline.model, cfg.pipeline.dataset
    folder = out / "models" / "base"
    image_size = m.image_size or frame_side(d.env_id, dict(d.env_options))
    settings = section_settings("pipeline.model", m) | {"pipeline.model.image_size": image_size}
    present = (folder / "config.json").is_file()
    if finished(out, "model", settings, str(folder), present):
        say(f"model: the {m.preset} {m.arch} policy is already at {folder}; skipped")
    else:
        built = build_model(
            m.preset,
            folder,
            corpus=text_corpus(),
            seed=m.seed,
            image_size=image_size,
            patch_size=m.patch_size,
            merge_size=m.merge_size,
            arch=m.arch,
            text_overrides=m.text,
            vision_overrides=m.vision,
            image_mean=m.image_mean,
            image_std=m.image_std,
            position_table=m.position_table,
            overwrite=True,
        )
        say(f"built the {m.preset} policy ({built.num_parameters:,} parameters) at {folder}")
        record(out, "model", settings, path=str(folder))
    return updated(cfg, {"sft.model_path": str(folder)})


def grpo_exports(cfg: ClewConfig) -> str:
    """Where the GRPO run of ``cfg`` exports its policies (``trainer.export_path``, else the
    run folder's exports/)."""
    run_dir = Path(cfg.trainer.log_path) / cfg.trainer.run_name
    return cfg.trainer.export_path or str(run_dir / "exports")


def sft_final_policy(cfg: ClewConfig) -> str:
    """Where the SFT run of ``cfg`` exports its final policy."""
    from clew.checkpoint.storage import join

    run_dir = Path(cfg.trainer.log_path) / cfg.sft.run_name
    return join(cfg.sft.export_path or str(run_dir / "exports"), "final", "policy")


def _sft(cfg: ClewConfig, out: Path) -> ClewConfig:
    """Runs SFT (`clew sft`); sets trainer.policy.model.path to its final policy."""
    from clew.checkpoint.storage import Storage, join

    final = sft_final_policy(cfg)
    settings = (
        section_settings("sft", cfg.sft)
        | {"data.train_data": cfg.data.train_data}
        | upstream(cfg, out, ("dataset", "model"))
    )
    present = Storage.for_path(final).exists(join(final, "config.json"))
    run_dir = str(Path(cfg.trainer.log_path) / cfg.sft.run_name)
    if finished(out, "sft", settings, run_dir, present):
        say(f"sft: the final policy is already at {final}; skipped")
    else:
        from clew.trainer.sft_launch import run_sft_stage

        say(f"sft: {cfg.sft.steps} steps of {cfg.sft.batch_size} expert episodes")
        result = run_sft_stage(cfg)
        final = result.final_policy
        passed = result.last_eval.get(EVAL_KEY)
        say(
            f"sft: the final policy (step {result.step}) is at {final}"
            + ("" if passed is None else f"; eval pass@1 {passed:.1%}")
        )
        record(out, "sft", settings, policy=final)
    return updated(cfg, {"trainer.policy.model.path": final})


def _train(cfg: ClewConfig, out: Path) -> ClewConfig:
    """Runs GRPO (`clew train`), resuming its latest checkpoint."""
    from clew.trainer.launch import run_grpo

    t, g = cfg.trainer, cfg.generator
    say(
        f"GRPO: {t.max_steps if t.max_steps >= 0 else 'all'} steps of {t.train_batch_size} "
        f"prompts x {g.n_samples_per_prompt} samples from {t.policy.model.path}"
    )
    run_grpo(cfg)
    return cfg


def _test(cfg: ClewConfig, out: Path) -> ClewConfig:
    """Plays GRPO's start, final and best policies on held-out mazes (clew.trainer.heldout);
    made again when GRPO has exported a later step since."""
    from clew.trainer import heldout

    policies = heldout.grpo_policies(cfg)
    settings = (
        section_settings("pipeline.test", cfg.pipeline.test)
        | heldout.depends_on(cfg)
        | upstream(cfg, out, ("dataset", "model", "sft"))
    )
    done = heldout.read_results(out)
    rows_made = (out / heldout.ROWS_FILE).is_file()
    present = rows_made and done is not None and heldout.evaluated(done) == policies
    if finished(out, "test", settings, str(out / heldout.TEST_FILE), present):
        say(f"test: the figures of {', '.join(done or ())} are already in {out}; skipped")
    else:
        names = ", ".join(f"{p.name} (step {p.step})" for p in policies)
        say(f"test: {names} on {cfg.pipeline.test.rows} held-out mazes")
        heldout.run_test(cfg, out, policies, say)
        record(out, "test", settings, rows=str(out / heldout.ROWS_FILE))
    return cfg


_STAGE_FNS: dict[str, Callable[[ClewConfig, Path], ClewConfig]] = {
    "dataset": _dataset,
    "model": _model,
    "sft": _sft,
    "train": _train,
    "test": _test,
}


# -- the result ---------------------------------------------------------------------------


def _compared(evals: list[tuple[int, float]], reached: int) -> str:
    """The first and last of GRPO's evaluations (step, pass@1), each with its step, and the
    step GRPO ``reached``: a run stopped before its second evaluation says it has none
    after the first, rather than give the first as the result of GRPO."""
    (start_step, start), (last_step, final) = evals[0], evals[-1]
    first = "SFT start" if start_step == 0 else "first evaluation"
    if last_step == start_step:
        return (
            f"{first} {start:.1%} (step {start_step}); GRPO reached step {reached} with no "
            "evaluation after that one (stopped before its next), so none after GRPO"
        )
    of = f" of {reached}" if reached > last_step else ""
    return (
        f"{first} {start:.1%} (step {start_step}), after GRPO {final:.1%} (step "
        f"{last_step}{of}, {100 * (final - start):+.1f} points)"
    )


def report(cfg: ClewConfig, out: Path) -> dict[str, float]:
    """GRPO's evaluations in brief, with the 'test' stage's figures where it ran in this
    chain: LOG/summary.json, the run's report.png, a few lines."""
    from clew.data.rows import read_rows
    from clew.metrics import draw_report, read_history
    from clew.trainer import heldout
    from clew.trainer.selection import SELECT_METRIC, best_evaluation

    run_dir = Path(cfg.trainer.log_path) / cfg.trainer.run_name
    history = read_history(run_dir)
    evals = [
        (h["step"], h[EVAL_KEY])
        for h in history
        if isinstance(h.get(EVAL_KEY), int | float) and math.isfinite(h[EVAL_KEY])
    ]
    held_out = heldout.summary_figures(out) if "test" in cfg.pipeline.stages else {}
    if not evals:
        say(f"GRPO logged no {EVAL_KEY} (data.val_data empty or trainer.eval_interval -1)")
        if held_out:
            write_json(out / SUMMARY_FILE, held_out)
            say(heldout.describe(out))
        return held_out
    (_, start), (last_step, final) = evals[0], evals[-1]
    reached = max(h["step"] for h in history)
    # The step trainer.export_best kept: picked by the selection set where GRPO had one.
    found = best_evaluation(history)
    assert found is not None  # evals holds one at least
    metric, best_step, picked = found
    best = dict(evals)[best_step]  # the eval figure there, whichever set picked the step
    summary = {
        "sft_pass_at_1": start,
        "final_pass_at_1": final,
        "gain_points": 100 * (final - start),
        "best_pass_at_1": best,
        "best_step": best_step,
    }
    if metric == SELECT_METRIC:
        summary["best_select_pass_at_1"] = picked
    summary |= held_out
    write_json(out / SUMMARY_FILE, summary)
    png = draw_report(run_dir)
    rows = [r for p in cfg.data.val_data for r in read_rows(p)]
    env_ids = ", ".join(sorted({r.env_id for r in rows}))
    say(f"eval pass@1 on {len(rows)} fixed {env_ids} mazes: " + _compared(evals, reached))
    export_path = Path(grpo_exports(cfg))
    if best_step != last_step:
        kept = export_path / "best" / "policy"
        by = f" (picked by {metric}: {picked:.1%})" if metric == SELECT_METRIC else ""
        say(
            f"best evaluation: {best:.1%} at step {best_step}{by}"
            + (f", kept as {kept}" if kept.is_dir() else "")
        )
    if held_out:
        say(heldout.describe(out))
    gifs = sorted((export_path / "eval").glob(f"global_step_{last_step}/gifs/solved*.gif"))
    say(f"report: {png}" + (f"; a solved maze: {gifs[0]}" if gifs else ""))
    return summary
