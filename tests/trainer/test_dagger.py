"""DAgger for SFT (clew.trainer.dagger): the solver labels the states the policy went wrong in."""

from __future__ import annotations

import random

import pytest

from clew.cli import main
from clew.config import load_config
from clew.data.rows import generate_rows, write_rows
from clew.envs import make
from clew.envs.maze.actions import Action, format_action
from clew.envs.maze.generate import DIRECTIONS
from clew.envs.maze.solver import shortest_actions
from clew.errors import ConfigError
from clew.inference.engine import EngineOptions, InferenceEngine
from clew.metrics import read_history
from clew.trainer.dagger import (
    DaggerSettings,
    branch_demonstrations,
    branch_points,
    mix_in,
)
from clew.trainer.demonstrations import Demonstration, play_demonstration
from clew.trainer.sft_launch import run_sft_stage

OPTIONS = {"cell_px": 28, "action_format": "keyword"}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def row():
    return generate_rows("maze_2d/tiny", 1, env_options=OPTIONS)[0]


def _solver_and_a_bump(row) -> tuple[list[str], str]:
    """The solver's replies, and a reply that bumps a wall after its first move."""
    env = make(row.env_id, **row.options())
    env.reset(row.seed)
    solver = [format_action(Action("move", d), "keyword") for d in shortest_actions(env.maze)]
    env.step(solver[0])
    r, c = env.agent
    wall = next(
        d for d, (dr, dc) in enumerate(DIRECTIONS) if not env.maze.is_open((r + dr, c + dc))
    )
    return solver + [format_action(Action("stop"), "keyword")], format_action(
        Action("move", wall), "keyword"
    )


def test_branch_points_are_the_turns_that_did_not_bring_the_agent_closer(row):
    solver, bump = _solver_and_a_bump(row)
    assert branch_points(row, solver) == []
    played = [solver[0], bump, bump, *solver[1:]]
    assert branch_points(row, played) == [1, 2]


def test_a_branch_keeps_the_policys_turns_as_context_and_trains_on_the_solver_after(row, chat):
    solver, bump = _solver_and_a_bump(row)
    prefix = [solver[0], bump, bump]
    demo = play_demonstration(row, chat, random.Random(0), prefix=prefix)
    assert demo is not None and demo.reward == 1.0
    assert demo.actions[:3] == prefix and demo.detour_turns == [0, 1, 2]
    assert demo.actions[3:] == solver[1:]  # from the bumped state the solver goes on
    replies = [chat.reply_tokens(a) for a in demo.actions]
    assert sum(demo.loss_mask) == sum(len(r) for r in replies[3:])
    # The env's reply to the second bump is in the context of the first trained turn.
    text = chat.decode(demo.token_ids[: demo.chunk_starts[3] + 200])
    assert text.count("hit a wall") == 2


def test_only_episodes_that_went_wrong_become_branch_demonstrations(row, chat):
    solver, bump = _solver_and_a_bump(row)
    rng = random.Random(3)
    demos = branch_demonstrations([row, row], [solver, [solver[0], bump, bump]], chat, rng)
    assert len(demos) == 1
    k = len(demos[0].detour_turns)
    assert k in (1, 2) and demos[0].actions[:k] == [solver[0], bump, bump][:k]


def test_mix_in_replaces_the_batchs_share_with_round_demonstrations():
    batch = [Demonstration([i], [1], []) for i in range(4)]
    branch = [Demonstration([9], [1], [])]
    mixed = mix_in(batch, branch, 0.5, random.Random(0))
    assert [d.token_ids[0] for d in mixed] == [0, 1, 9, 9]
    assert mix_in(batch, [], 0.5, random.Random(0)) == batch


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": 0}, "interval is a number of SFT steps >= 1"),
        ({"interval": 5, "share": 0.0}, "share is a share of each batch in (0, 1]"),
        ({"interval": 5, "temperature": -1.0}, "temperature must be >= 0"),
        ({"interval": 5, "rows": 0}, "rows must be >= 1"),
        ({"interval": 5, "keep_rounds": -1}, "keep_rounds is a number of rounds >= 0"),
    ],
)
def test_bad_dagger_settings_are_refused_with_the_rule(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DaggerSettings(**kwargs)


def test_sft_with_dagger_rounds_plays_the_policy_and_trains_on_its_branches(model_dir, tmp_path):
    data = tmp_path / "train.parquet"
    write_rows(generate_rows("maze_2d/tiny", 8, env_options=OPTIONS), data)
    cfg = load_config(
        None,
        [
            f"sft.model_path={model_dir}", f"data.train_data=['{data}']",
            f"trainer.log_path={tmp_path / 'runs'}", "trainer.logger=jsonl",
            "sft.steps=5", "sft.batch_size=4", "sft.optimizer_config.lr=3e-3",
            "sft.dagger.interval=2", "sft.dagger.rows=4", "sft.dagger.share=0.5",
            "sft.dagger.keep_rounds=0",
        ],
    )  # fmt: skip
    logged = {r["step"]: r for r in read_history(run_sft_stage(cfg).run_dir)}
    rounds = [s for s, m in logged.items() if "sft/dagger_solve_rate" in m]
    assert rounds == [3, 5]  # after 2 and 4 steps
    for s in rounds:  # the shares and counts of a round's 4 episodes
        assert logged[s]["sft/dagger_solve_rate"] in (0.0, 0.25, 0.5, 0.75, 1.0)
        assert logged[s]["sft/dagger_demonstrations"] in (0.0, 1.0, 2.0, 3.0, 4.0)
    # keep_rounds=0 aggregates: the pool after the second round holds both rounds' branches
    made = [logged[s]["sft/dagger_demonstrations"] for s in rounds]
    assert [logged[s]["sft/dagger_pool"] for s in rounds] == [made[0], made[0] + made[1]]


def test_sft_evaluations_and_dagger_episodes_run_on_the_configured_engine(
    model_dir, tmp_path, monkeypatch
):
    built: list[InferenceEngine] = []
    build = EngineOptions.build

    def recording(options, *args, **kwargs):
        built.append(build(options, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(EngineOptions, "build", recording)
    data = tmp_path / "train.parquet"
    write_rows(generate_rows("maze_2d/tiny", 8, env_options=OPTIONS), data)
    cfg = load_config(
        None,
        [
            f"sft.model_path={model_dir}", f"data.train_data=['{data}']",
            f"data.val_data=['{data}']", f"trainer.log_path={tmp_path / 'runs'}",
            "trainer.logger=jsonl", "sft.steps=3", "sft.batch_size=4", "sft.eval_interval=2",
            "sft.dagger.interval=2", "sft.dagger.rows=4",
            "generator.inference_engine.decode_attention=sdpa",
            "generator.inference_engine.max_cache_mb=96",
        ],
    )  # fmt: skip
    logged = read_history(run_sft_stage(cfg).run_dir)
    assert any("sft/dagger_solve_rate" in m for m in logged)
    assert any("eval/all/pass_at_1" in m for m in logged)
    assert len(built) >= 2  # a DAgger round and an evaluation, at least
    assert {(e.decode_attention, e.max_cache_bytes) for e in built} == {("sdpa", 96 * 2**20)}


def _demos(*seeds: int) -> list[Demonstration]:
    return [Demonstration([], [], [], row_seed=s) for s in seeds]


def test_sft_command_refuses_a_bad_dagger_share_before_any_work(model_dir, tmp_path, capsys):
    data = tmp_path / "train.parquet"
    write_rows(generate_rows("maze_2d/tiny", 2, env_options=OPTIONS), data)
    code = main(["sft", "--model", str(model_dir), "--data", str(data),
                 f"trainer.log_path={tmp_path / 'runs'}",
                 "sft.dagger.interval=5", "sft.dagger.share=1.5"])  # fmt: skip
    assert code == 2
    assert "sft.dagger.share is a share of each batch in (0, 1], got 1.5" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_sft_command_decays_the_learning_rate_on_the_chosen_schedule(model_dir, tmp_path):
    data = tmp_path / "train.parquet"
    write_rows(generate_rows("maze_2d/tiny", 2, env_options=OPTIONS), data)
    code = main(["sft", "--model", str(model_dir), "--data", str(data), "--steps", "4",
                 "--batch-size", "2", "--lr", "1e-3", f"trainer.log_path={tmp_path / 'runs'}",
                 "sft.optimizer_config.num_warmup_steps=0",
                 "sft.optimizer_config.scheduler=linear"])  # fmt: skip
    assert code == 0
    lrs = [r["sft/lr"] for r in read_history(tmp_path / "runs" / "sft")]
    # Each step logs the rate it stepped with: 1e-3, then a quarter less each step.
    assert lrs == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])


def test_sft_command_names_the_schedules_it_accepts(model_dir, tmp_path, capsys):
    code = main(["sft", "--model", str(model_dir), "--data", "x",
                 "sft.optimizer_config.scheduler=cosin"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "sft.optimizer_config.scheduler" in err
    assert "got 'cosin'" in err and "'cosine'" in err
