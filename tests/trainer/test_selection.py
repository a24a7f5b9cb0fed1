"""The selection set (data.select_data, pipeline.dataset.select_rows): its pass@1 picks the
policy GRPO keeps, apart from the eval set the figures are reported on."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from clew.checkpoint.state import Checkpointer
from clew.config import load_config
from clew.data.rows import generate_rows, read_rows, task_keys, write_rows
from clew.errors import ConfigError
from clew.rollout.trajectory import Trajectory
from clew.trainer import heldout, pipeline, stage_records
from clew.trainer.grpo import GRPOTrainer
from clew.trainer.launch import check_runnable
from clew.trainer.pipeline import report

EVAL = "eval/all/pass_at_1"
SELECT = "select/all/pass_at_1"


class _Group:
    """A worker group without a model. Training episodes earn reward on their first sample;
    at evaluation number k (counted from 0) the rows of ``solved[k]``'s sets ("eval",
    "select", told apart by seed) are all solved and the others all failed."""

    world_size = 1

    def __init__(self, select_seeds: set[int], solved: list[set[str]]) -> None:
        self.select_seeds, self.solved = select_seeds, solved
        self.evaluations: list[int] = []  # the rows each evaluation's one rollout played

    def generate(self, rows, settings, seed, progress=None):
        evaluating = settings.sampling.temperature == 0.0
        if evaluating:
            self.evaluations.append(len(rows))
            solved = self.solved[len(self.evaluations) - 1]
        out = []
        for g, row in enumerate(rows):
            kind = "select" if int(row.seed) in self.select_seeds else "eval"
            for s in range(settings.n_samples_per_prompt):
                t = Trajectory(row.env_id, {}, int(row.seed), g, s)
                win = kind in solved if evaluating else s == 0
                t.reward, t.end_reason = float(win), "stop"
                out.append(t)
        return out

    def update(self, batch, settings):
        return {"policy/optimizer_steps": 1.0, "policy/skipped_steps": 0.0}

    def export(self, path):
        Path(path, "weights.txt").write_text("policy\n")


class _Loggers:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.records.append((step, dict(metrics)))


def _trainer(
    tmp_path: Path, *, select: bool, solved: list[set[str]] = (), loggers=None, more=()
) -> tuple[GRPOTrainer, _Group]:
    """A GRPO trainer of 4 eval rows and, with ``select``, 3 selection rows of other seeds,
    on a model-less group, exporting into ``tmp_path``."""
    cfg = load_config(
        None,
        [
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=1",
            "generator.n_samples_per_prompt=2",
            "trainer.eval_before_train=false",
            "trainer.ckpt_interval=-1",
            "trainer.max_steps=6",
            "trainer.eval_interval=2",
            *more,
        ],
    )
    train = generate_rows("maze_2d/small", 16, "train")
    evals = generate_rows("maze_2d/small", 4, "eval")
    chosen = generate_rows("maze_2d/small", 3, "eval", seed_start=3_000_000_000) if select else []
    group = _Group({int(r.seed) for r in chosen}, list(solved))
    trainer = GRPOTrainer(
        cfg,
        group,
        train,
        evals,
        loggers or _Loggers(),
        tmp_path,
        Checkpointer(cfg, tmp_path),
        select_rows=chosen,
    )
    return trainer, group


def _best_record(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "exports" / "best" / "best.json").read_text())


# Three evaluations on which the two sets disagree: the eval set is best at the third,
# the selection set at the second.
DISAGREEING = [(2, 0.5, 0.2), (4, 0.25, 0.75), (6, 1.0, 0.5)]


def test_with_selection_rows_the_selection_pass_at_1_picks_the_best_policy(tmp_path, capsys):
    trainer, _ = _trainer(tmp_path, select=True)
    for step, eval_pass, select_pass in DISAGREEING:
        trainer.state.global_step = step
        trainer.keep_best({EVAL: eval_pass, SELECT: select_pass})
    state = trainer.state
    assert (state.best_step, state.best_eval, state.best_metric) == (4, 0.75, SELECT)
    record = _best_record(tmp_path)
    # best.json names the metric that picked, and keeps the eval figure reported there.
    assert record["step"] == 4 and record["picked_by"] == SELECT
    assert record[SELECT] == 0.75 and record[EVAL] == 0.25
    assert f"step 4, {SELECT} 75.0%" in capsys.readouterr().out


def test_without_selection_rows_the_eval_pass_at_1_picks_the_best_policy(tmp_path):
    trainer, _ = _trainer(tmp_path, select=False)
    for step, eval_pass, select_pass in DISAGREEING:
        trainer.state.global_step = step
        trainer.keep_best({EVAL: eval_pass, SELECT: select_pass})
    assert (trainer.state.best_step, trainer.state.best_metric) == (6, EVAL)
    record = _best_record(tmp_path)
    assert record["step"] == 6 and record["picked_by"] == EVAL and record[EVAL] == 1.0
    assert SELECT not in record


def test_a_resumed_run_never_compares_a_best_of_one_set_with_a_figure_of_the_other(
    tmp_path, capsys
):
    # A checkpoint written before the loop recorded its metric: its best is the eval set's.
    old = {"global_step": 4, "best_eval": 0.9, "best_step": 2}
    trainer, _ = _trainer(tmp_path / "a", select=True)
    trainer.load_state_dict(old)
    assert trainer.state.best_metric == EVAL
    trainer.state.global_step = 6
    trainer.keep_best({EVAL: 0.5, SELECT: 0.3})  # 0.3 < 0.9, but of another set
    assert (trainer.state.best_step, trainer.state.best_metric) == (6, SELECT)
    assert f"was picked by {EVAL}; this run picks by {SELECT}" in capsys.readouterr().out
    # Its own checkpoint carries the metric: a resume of it goes on comparing selection figures.
    again, _ = _trainer(tmp_path / "b", select=True)
    again.load_state_dict(trainer.state_dict())
    again.state.global_step = 8
    again.keep_best({EVAL: 1.0, SELECT: 0.2})
    assert (again.state.best_step, again.state.best_eval) == (6, 0.3)
    # Without selection rows the old checkpoint's best stands.
    plain, _ = _trainer(tmp_path / "c", select=False)
    plain.load_state_dict(old)
    plain.state.global_step = 6
    plain.keep_best({EVAL: 0.5})
    assert (plain.state.best_step, plain.state.best_eval) == (2, 0.9)


def test_each_evaluation_plays_both_sets_in_one_rollout_and_logs_select_metrics(tmp_path):
    loggers = _Loggers()
    solved = [{"eval"}, {"select"}, set()]  # the evaluations of steps 2, 4 and 6
    trainer, group = _trainer(tmp_path, select=True, solved=solved, loggers=loggers)
    trainer.fit()
    assert group.evaluations == [4 + 3] * 3  # one rollout each, eval rows and selection rows
    evaluated = {step: m for step, m in loggers.records if EVAL in m}
    assert sorted(evaluated) == [2, 4, 6]
    assert [(evaluated[s][EVAL], evaluated[s][SELECT]) for s in (2, 4, 6)] == [
        (1.0, 0.0),
        (0.0, 1.0),
        (0.0, 0.0),
    ]
    assert evaluated[4]["select/all/episodes"] == 3.0 and evaluated[4]["eval/all/episodes"] == 4.0
    between = [k for step, m in loggers.records if step not in evaluated for k in m]
    assert between and not any(k.startswith("select/") for k in between)
    assert _best_record(tmp_path)["step"] == 4  # the selection set's best, not step 2


def test_selection_rows_without_eval_rows_are_refused():
    cfg = load_config(
        None,
        [
            "data.train_data=['t.parquet']",
            "data.select_data=['s.parquet']",
            "trainer.policy.model.path=m",
        ],
    )
    with pytest.raises(ConfigError, match="data.select_data .* data.val_data"):
        check_runnable(cfg)


# -- the pipeline ----------------------------------------------------------------------------


def _pipeline_cfg(out: Path, *extra: str):
    return load_config(
        None,
        [
            f"trainer.log_path={out}",
            "pipeline.dataset.env_id=maze_2d/small",
            "pipeline.dataset.train_rows=4",
            "pipeline.dataset.eval_rows=4",
            # Every walk from the eval set's first seed: only the exclusions keep them apart.
            "pipeline.dataset.select_seed_start=1000000000",
            "pipeline.test.seed_start=1000000000",
            "pipeline.test.rows=6",
            *extra,
        ],
    )


def test_the_dataset_stage_writes_selection_rows_of_tasks_no_eval_or_test_row_has(tmp_path):
    cfg = pipeline._dataset(_pipeline_cfg(tmp_path, "pipeline.dataset.select_rows=5"), tmp_path)
    select = tmp_path / "data" / "select.parquet"
    assert cfg.data.select_data == [str(select)]
    chosen, evals = read_rows(select), read_rows(cfg.data.val_data[0])
    assert len(chosen) == 5 and {r.split for r in chosen} == {"eval"}
    assert len(task_keys(chosen)) == 5 and not task_keys(chosen) & task_keys(evals)
    held_out = task_keys(heldout.held_out_rows(cfg))
    assert len(held_out) == 6 and not held_out & (task_keys(chosen) | task_keys(evals))
    # The 'test' stage's record names the selection set it stayed apart from.
    assert heldout.depends_on(cfg)["data.select_data"] == [str(select)]


def test_changing_select_rows_is_never_skipped_and_the_data_is_made_again(tmp_path, capsys):
    pipeline._dataset(_pipeline_cfg(tmp_path, "pipeline.dataset.select_rows=3"), tmp_path)
    pipeline._dataset(_pipeline_cfg(tmp_path, "pipeline.dataset.select_rows=3"), tmp_path)
    assert "4 train, 4 eval, 3 select rows of maze_2d/small are already in" in (
        capsys.readouterr().out
    )
    changed = _pipeline_cfg(tmp_path, "pipeline.dataset.select_rows=4")
    with pytest.raises(ConfigError, match="pipeline.dataset.select_rows: 3 there, 4 now"):
        pipeline._dataset(changed, tmp_path)
    # Deleting the output, as the error says, makes it again from the new settings.
    for path in (tmp_path / "data").iterdir():
        path.unlink()
    pipeline._dataset(changed, tmp_path)
    assert pq.read_metadata(tmp_path / "data" / "select.parquet").num_rows == 4


def test_without_select_rows_the_stage_writes_none_and_keeps_its_old_record(tmp_path, capsys):
    cfg = pipeline._dataset(_pipeline_cfg(tmp_path, "data.select_data=['mine.parquet']"), tmp_path)
    assert not (tmp_path / "data" / "select.parquet").exists()
    assert cfg.data.select_data == ["mine.parquet"]  # as given
    record = json.loads((tmp_path / stage_records.STAGES_FILE).read_text())["dataset"]["settings"]
    assert not any("select" in key for key in record)  # as a record made before it exists
    pipeline._dataset(_pipeline_cfg(tmp_path), tmp_path)
    assert "skipped" in capsys.readouterr().out


def test_the_summary_gives_the_best_step_the_selection_set_picked_and_its_figures(tmp_path):
    out, run = tmp_path / "pipeline", tmp_path / "pipeline" / "grpo"
    run.mkdir(parents=True)
    history = [{"step": s, EVAL: e, SELECT: c} for s, e, c in [(0, 0.1, 0.1), *DISAGREEING]]
    (run / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    write_rows(generate_rows("maze_2d/small", 4, "eval"), tmp_path / "eval.parquet")
    cfg = load_config(
        None,
        [
            f"trainer.log_path={out}",
            "trainer.run_name=grpo",
            f"data.val_data=['{tmp_path / 'eval.parquet'}']",
        ],
    )
    summary = report(cfg, out)
    assert summary == json.loads((out / "summary.json").read_text())
    assert (summary["best_step"], summary["best_pass_at_1"]) == (4, 0.25)
    assert summary["best_select_pass_at_1"] == 0.75
    assert summary["final_pass_at_1"] == 1.0
