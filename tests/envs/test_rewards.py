"""Reward rules (clew's and the SkyRL + VisGym walkthrough's) and the two pass rules that
evaluation reports side by side."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clew.envs.rewards import (
    REWARD_RULES,
    format_share,
    has_valid_format,
    passes,
    reward_rule,
    skyrl_visgym_rule,
    task_rule,
    trajectory_reward,
)
from clew.errors import ConfigError
from clew.metrics.catalog import describe
from clew.rollout.evaluation import eval_metrics, headline
from clew.rollout.trajectory import Trajectory

GOOD = "<observation>a wall to the right</observation><justification>the goal is up</justification><action>('move', 1)</action>"


class SkyRLEnvReward:
    """SkyRL's VisGymEnv reward bookkeeping, transcribed from examples/train/visgym/env_sft.py
    (NovaSky-AI/SkyRL): a counter of well-formed replies per step, and at the end
    0.8 * task reward + 0.2 * format_successes / step_count."""

    _xml = {
        tag: re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL)
        for tag in ("observation", "justification", "action")
    }

    def __init__(self) -> None:
        self.step_count = 0
        self.format_successes = 0

    def step(self, action: str) -> None:
        self.step_count += 1
        ok = True
        for pattern in self._xml.values():
            match = pattern.search(action)
            if not match or not match.group(1).strip():
                ok = False
                break
        if ok:
            self.format_successes += 1

    def terminal_reward(self, task_reward: float) -> float:
        return 0.8 * task_reward + 0.2 * (self.format_successes / self.step_count)


def _skyrl(task_reward: float, replies: list[str]) -> float:
    env = SkyRLEnvReward()
    for r in replies:
        env.step(r)
    return env.terminal_reward(task_reward)


def test_the_task_rule_returns_the_task_reward_whatever_the_replies():
    assert task_rule(1.0, ["anything"]) == 1.0
    assert task_rule(0.0, [GOOD, GOOD]) == 0.0
    assert task_rule(True, []) == 1.0
    assert reward_rule("task") is task_rule


def test_skyrl_visgym_pays_point_eight_for_the_goal_and_point_two_for_the_format_share():
    assert skyrl_visgym_rule(1.0, [GOOD, GOOD]) == pytest.approx(1.0)
    assert skyrl_visgym_rule(1.0, ["('move', 1)", "('stop', 'stop')"]) == pytest.approx(0.8)
    assert skyrl_visgym_rule(0.0, [GOOD, "('move', 1)", GOOD, "x"]) == pytest.approx(0.1)
    assert skyrl_visgym_rule(False, ["x"]) == 0.0
    assert reward_rule("skyrl_visgym") is skyrl_visgym_rule


@pytest.mark.parametrize(
    ("reply", "valid"),
    [
        (GOOD, True),
        # Any order of the three tags.
        (
            "<action>stop</action><justification>on it</justification><observation>goal</observation>",
            True,
        ),
        # Multiline content (DOTALL) and text around the tags.
        (
            "I think\n<observation>row 1\nrow 2</observation>\n<justification>\nso\n</justification>\n<action>\n('move', 0)\n</action> done",
            True,
        ),
        # Blank content, whitespace only, or a missing tag fails.
        ("<observation></observation><justification>j</justification><action>a</action>", False),
        (
            "<observation>o</observation><justification> \n\t</justification><action>a</action>",
            False,
        ),
        ("<observation>o</observation><justification>j</justification>", False),
        ("<observation>o</observation><action>a</action>", False),
        # Only the first match of a tag counts: an empty first <action> fails.
        (
            "<observation>o</observation><justification>j</justification><action></action><action>a</action>",
            False,
        ),
        # Tags nested in another count where their first match has content.
        ("<observation>o <action>a</action></observation><justification>j</justification>", True),
        ("<observation><justification>j</justification></observation><action>a</action>", True),
        # An unclosed tag does not match; tags are case-sensitive.
        ("<observation>o<justification>j</justification><action>a</action>", False),
        ("<Observation>o</Observation><justification>j</justification><action>a</action>", False),
        ("", False),
    ],
)
def test_format_check_follows_skyrls_tag_rule(reply: str, valid: bool):
    assert has_valid_format(reply) is valid
    assert skyrl_visgym_rule(0.0, [reply]) == pytest.approx(_skyrl(0.0, [reply]))


_tagged = st.lists(
    st.sampled_from(
        ["<observation>", "</observation>", "<justification>", "</justification>", "<action>",
         "</action>", "x", " ", "\n", "('move', 0)", ""]
    ),
    max_size=12,
).map("".join)  # fmt: skip


@given(task=st.sampled_from([0.0, 1.0]), replies=st.lists(_tagged, min_size=1, max_size=8))
def test_skyrl_visgym_matches_skyrls_bookkeeping_on_any_replies(task: float, replies: list[str]):
    assert trajectory_reward("skyrl_visgym", task, replies) == pytest.approx(_skyrl(task, replies))


def test_bad_rule_names_and_inputs_are_clear_errors():
    with pytest.raises(ConfigError, match="unknown reward rule 'skyrl'.*task, skyrl_visgym"):
        reward_rule("skyrl")
    with pytest.raises(ValueError, match="no replies"):
        skyrl_visgym_rule(1.0, [])
    with pytest.raises(TypeError, match="sequence of reply texts"):
        skyrl_visgym_rule(1.0, GOOD)
    with pytest.raises(TypeError, match="must be a str"):
        format_share([GOOD, None])
    with pytest.raises(ValueError, match="finite number"):
        task_rule(float("nan"), ["x"])
    with pytest.raises(ValueError, match="finite number"):
        skyrl_visgym_rule("1", ["x"])
    assert set(REWARD_RULES) == {"task", "skyrl_visgym"}


def test_the_pass_rule_is_a_reward_above_zero():
    assert passes(0.2) and passes(1.0)
    assert not passes(0.0) and not passes(-0.5)


def _traj(group: int, task: float, replies: list[str], rule: str) -> Trajectory:
    t = Trajectory("maze_2d/easy", {}, group, group, 0)
    t.actions, t.turns = replies, len(replies)
    t.reward = trajectory_reward(rule, task, replies)
    t.task_reward = task
    return t


def test_eval_reports_the_walkthroughs_pass_at_1_beside_the_solve_rate():
    # Under the walkthrough's rule: one solve, one failure with format credit, one without.
    trajs = [
        _traj(0, 1.0, [GOOD, GOOD], "skyrl_visgym"),
        _traj(1, 0.0, [GOOD, "('move', 0)"], "skyrl_visgym"),
        _traj(2, 0.0, ["('move', 0)"], "skyrl_visgym"),
        _traj(3, 1.0, ["('stop', 'stop')"], "skyrl_visgym"),
    ]
    metrics = eval_metrics(trajs, [], max_turns=15)
    assert metrics["eval/all/reward_pass_at_1"] == pytest.approx(3 / 4)
    assert metrics["eval/all/solve_rate"] == pytest.approx(2 / 4)
    assert (
        metrics["eval/all/pass_at_1"] == metrics["eval/all/solve_rate"]
    )  # the key keeps its meaning
    line = headline(metrics)
    assert "\n" not in line
    assert "pass_at_1 (reward > 0, SkyRL's rule): 0.7500" in line
    assert "solve rate (stopped on the goal): 0.5000" in line
    assert describe("eval/all/reward_pass_at_1") and describe("eval/all/solve_rate")


def test_under_clews_task_rule_both_pass_rules_agree():
    trajs = [_traj(g, float(g % 2), [GOOD], "task") for g in range(6)]
    for t in trajs:
        t.task_reward = None  # the env's own reward, no rule on top
    metrics = eval_metrics(trajs, [], max_turns=15)
    assert metrics["eval/all/reward_pass_at_1"] == metrics["eval/all/solve_rate"] == 0.5


def test_a_runs_reward_rule_rescores_finished_trajectories_and_keeps_the_task_reward():
    from clew.config import load_config
    from clew.config.settings import rollout_settings
    from clew.rollout.trajectory import Trajectory, apply_reward_rule

    cfg = load_config(None, ["environment.reward_rule=skyrl_visgym"])
    assert rollout_settings(cfg, evaluation=True).reward_rule == "skyrl_visgym"
    tagged = "<observation>o</observation><justification>j</justification><action>a</action>"
    solved = Trajectory("maze_2d/easy", {}, 0, 0, 0, actions=[tagged, "x"], reward=1.0)
    solved.turn_rewards = [0.0, 1.0]
    failed = Trajectory("maze_2d/easy", {}, 1, 1, 0, actions=[tagged], reward=0.0)
    failed.turn_rewards = [0.0]
    apply_reward_rule([solved, failed], "skyrl_visgym")
    assert solved.reward == pytest.approx(0.8 + 0.2 * 0.5) and solved.success
    assert solved.turn_rewards == [0.0, solved.reward]
    assert failed.reward == pytest.approx(0.2) and not failed.success
    apply_reward_rule([failed], "skyrl_visgym")  # scoring twice changes nothing
    assert failed.reward == pytest.approx(0.2)


def test_an_unknown_reward_rule_fails_in_the_config():
    from clew.config import load_config
    from clew.errors import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'skyrl_visgym'"):
        load_config(None, ["environment.reward_rule=skyrl_visgim"])
