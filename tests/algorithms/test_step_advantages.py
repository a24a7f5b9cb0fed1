"""GiGPO's step-level advantages, hand-computed, and the per-turn plumbing around them."""

import pytest
import torch

from clew.algorithms import (
    EstimatorBatch,
    compute_advantages,
    discounted_returns,
    gigpo_advantages,
    grpo_advantages,
    step_advantages,
    turn_token_advantages,
)
from clew.config import load_config
from clew.envs import make
from clew.rollout.trajectory import state_key


def t(values):
    return torch.tensor(values, dtype=torch.float32)


def close(actual, expected):
    torch.testing.assert_close(actual, t(expected), atol=1e-6, rtol=0)


def test_discounted_returns_count_back_from_each_reward():
    close(discounted_returns(t([0.0, 0.0, 1.0]), 0.5), [0.25, 0.5, 1.0])
    close(discounted_returns(t([1.0, 0.0, 2.0]), 1.0), [3.0, 2.0, 2.0])
    close(discounted_returns(t([]), 0.9), [])
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns(t([1.0]), 0.0)


def test_turns_from_one_state_are_compared_and_lone_turns_get_zero():
    # Prompt 0: episodes A and B both act from state "s"; A then from "a", B from "b".
    # Prompt 1 also has a state keyed "s": it must not join prompt 0's step group.
    returns = [t([0.5, 1.0]), t([0.0, 0.0]), t([0.8])]
    keys = [["s", "a"], ["s", "b"], ["s"]]
    steps, stats = step_advantages(returns, keys, [0, 0, 1], norm_by_std=False)
    close(steps[0], [0.25, 0.0])
    close(steps[1], [-0.25, 0.0])
    close(steps[2], [0.0])
    assert stats == {"step_groups": 1.0, "grouped_turn_fraction": 0.4, "step_group_size_mean": 2.0}


def test_a_state_revisited_within_one_episode_joins_its_own_step_group():
    # A loop: the episode is back at "s" on turn 2 and reaches the goal on turn 3.
    steps, _ = step_advantages([t([0.25, 0.5, 1.0])], [["s", "x", "s"]], [7], norm_by_std=False)
    close(steps[0], [-0.375, 0.0, 0.375])


def test_from_a_shared_junction_the_move_reaching_the_goal_sooner_gets_the_higher_advantage():
    # Both episodes solve the maze (episode rewards equal: GRPO gives both 0), but from the
    # junction "j" one took 2 more turns through a dead end.
    rewards = t([1.0, 1.0])
    turn_rewards = [t([0.0, 0.0, 1.0]), t([0.0, 0.0, 0.0, 0.0, 1.0])]
    keys = [["start", "j", "near"], ["start", "j", "dead", "j", "near"]]
    batch = EstimatorBatch(rewards, [0, 0], turn_rewards=turn_rewards, state_keys=keys)
    result = compute_advantages("gigpo", batch, {"gigpo": {"gamma": 0.9}})
    close(result.advantages, [0.0, 0.0])
    short, long = result.turn_advantages
    assert short[1] > 0 > long[1]  # the junction turns
    assert short[0] > 0 > long[0]  # from the start, the shorter episode is better too
    assert long[3] > 0  # the second visit of "j", after the dead end, did better than the first
    assert result.zero_spread_groups == 1


def test_gigpo_adds_the_weighted_step_advantage_to_the_episode_one():
    rewards = t([1.0, 0.0])
    turn_rewards = [t([0.0, 1.0]), t([0.0, 0.0])]
    keys = [["s", "a"], ["s", "b"]]
    batch = EstimatorBatch(rewards, [0, 0], turn_rewards=turn_rewards, state_keys=keys)
    result = compute_advantages("gigpo", batch, {"gigpo": {"gamma": 0.5, "step_advantage_w": 2.0}})
    episode = grpo_advantages(rewards, [0, 0]).advantages
    step, _ = step_advantages([t([0.5, 1.0]), t([0.0, 0.0])], keys, [0, 0])
    for i in range(2):
        close(result.turn_advantages[i], (episode[i] + 2.0 * step[i]).tolist())
    zero_w = compute_advantages("gigpo", batch, {"gigpo": {"step_advantage_w": 0.0}})
    close(zero_w.turn_advantages[0], [episode[0].item()] * 2)


def test_mismatched_turns_and_keys_are_refused():
    with pytest.raises(ValueError, match="one return and one key per turn"):
        step_advantages([t([1.0, 0.0])], [["s"]], [0])
    with pytest.raises(ValueError, match="one of each per episode"):
        step_advantages([t([1.0])], [["s"]], [0, 1])


def test_turn_advantages_land_on_their_own_reply_tokens():
    mask = [0, 1, 0, 0, 1, 1, 0]
    close(turn_token_advantages(t([2.0, -1.0]), mask), [0, 2, 0, 0, -1, -1, 0])
    with pytest.raises(ValueError, match="replies for 3 turn advantages"):
        turn_token_advantages(t([2.0, -1.0, 0.5]), mask)
    with pytest.raises(ValueError, match="replies for 1 turn advantages"):
        turn_token_advantages(t([2.0]), mask)


def test_state_key_names_the_frame_not_the_turn_text():
    env = make("maze_2d/small", action_format="keyword")
    for there, back in (("right", "left"), ("left", "right"), ("up", "down"), ("down", "up")):
        obs = env.reset(3)
        moved, _, _, info = env.step(f"<action>{there}</action>")
        if info["event"] == "moved":
            returned, _, _, _ = env.step(f"<action>{back}</action>")
            break
    else:
        pytest.fail("no open move from the start")
    start = state_key(obs.images, obs.text)
    assert state_key(moved.images, moved.text) != start
    assert returned.text != obs.text
    assert state_key(returned.images, returned.text) == start
    assert state_key([], "a") == state_key([], "a") != state_key([], "b")


def test_gigpo_reads_its_settings_under_the_config_key_names():
    cfg = load_config(
        None,
        [
            "trainer.algorithm.advantage_estimator=gigpo",
            "trainer.algorithm.gigpo.gamma=0.5",
            "trainer.algorithm.gigpo.step_advantage_w=2.0",
            "trainer.algorithm.norm_adv_by_std_in_grpo=false",
            "trainer.algorithm.drop_zero_spread_groups=true",
        ],
    )
    rewards = t([1.0, 0.0, 1.0, 1.0])
    turn_rewards = [t([0.0, 1.0]), t([0.0, 0.0]), t([1.0]), t([1.0])]
    keys = [["s", "a"], ["s", "b"], ["s"], ["s"]]
    batch = EstimatorBatch(rewards, [0, 0, 1, 1], turn_rewards=turn_rewards, state_keys=keys)
    got = compute_advantages("gigpo", batch, cfg.trainer.algorithm.model_dump())
    want = gigpo_advantages(
        rewards,
        [0, 0, 1, 1],
        turn_rewards=turn_rewards,
        state_keys=keys,
        gamma=0.5,
        step_advantage_w=2.0,
        norm_adv_by_std_in_grpo=False,
        drop_zero_spread=True,
    )
    assert got.keep.tolist() == want.keep.tolist() == [True, True, False, False]
    for a, b in zip(got.turn_advantages, want.turn_advantages, strict=True):
        torch.testing.assert_close(a, b)
    default = compute_advantages("gigpo", batch, {})
    assert not torch.equal(default.turn_advantages[0], got.turn_advantages[0])
