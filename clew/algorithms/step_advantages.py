"""Step-level advantages for multi-turn episodes: GiGPO's anchor-state groups.

GRPO gives every turn of an episode the episode's advantage, so a junction choice that
decided the episode is credited no more than the twenty moves around it. GiGPO (Feng et
al., 2025, "Group-in-Group Policy Optimization for LLM Agent Training") adds a second,
finer group without a critic or extra rollouts: the episodes of one prompt start from the
same state and pass through many of the same states again (in a maze, every cell the
samples share), so the turns taken from one *anchor state* (an identical observation)
form a step group. Each turn's discounted return ``G_t = r_t + gamma * G_{t+1}`` is
compared with the others of its step group, as GRPO compares episode rewards: from a
junction, the move that reached the goal sooner gets a positive step advantage, the one
that wandered into a dead end a negative one. A turn's advantage is

    A = A_episode + step_advantage_w * A_step,

with ``A_episode`` GRPO's (undiscounted episode reward within the prompt's group) and
``A_step`` 0 for turns whose state no other turn of the group acted from.

Written here, not taken from a library: verl-agent's implementation (the paper's) is
bound to its DataProto batches and text anchors; this one takes plain tensors and any
hashable state key (``clew.rollout.trajectory.state_key`` hashes the observation's images).
"""

from collections import Counter
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from clew.algorithms.advantages import grpo_advantages
from clew.algorithms.estimators import (
    AdvantageResult,
    EstimatorBatch,
    EstimatorSettings,
    GroupIds,
    register_estimator,
    setting,
)
from clew.algorithms.stats import upcast_float


def discounted_returns(turn_rewards: Tensor, gamma: float) -> Tensor:
    """``Float[T]`` rewards of one episode's turns -> ``Float[T]`` returns-to-go.

    ``G_t = r_t + gamma * G_{t+1}``, ``G_T = 0``. With the maze's sparse reward (1 on the
    last turn of a solved episode), ``G_t = gamma ** (T - 1 - t)``: sooner is better.
    """
    if turn_rewards.dim() != 1:
        raise ValueError(f"turn_rewards must be 1-D [T], got shape {tuple(turn_rewards.shape)}")
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    r = upcast_float(turn_rewards)
    out = torch.empty_like(r)
    running = torch.zeros((), dtype=r.dtype)
    for t in range(r.shape[0] - 1, -1, -1):
        running = r[t] + gamma * running
        out[t] = running
    return out


def step_advantages(
    returns: Sequence[Tensor],
    state_keys: Sequence[Sequence[Hashable]],
    group_ids: GroupIds,
    *,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[list[Tensor], dict[str, float]]:
    """GRPO over step groups: turns of one prompt's episodes taken from the same state.

    Args:
        returns: per episode, ``Float[T_i]`` the return from each turn.
        state_keys: per episode, ``T_i`` hashables naming the state each turn acted from.
        group_ids: ``Long[N]`` or ``N`` hashables: the prompt of each episode (states of
            different prompts never share a step group, even when their keys are equal).
        norm_by_std: divide by the step group's return std (as ``norm_adv_by_std_in_grpo``).

    Returns:
        Per episode ``Float[T_i]`` step advantages (0 in step groups of one turn or with all
        returns equal), and statistics: ``step_groups`` (groups of two or more turns),
        ``grouped_turn_fraction`` (share of turns in such groups), ``step_group_size_mean``.
    """
    if not len(returns) == len(state_keys) == len(group_ids):
        raise ValueError(
            f"got {len(returns)} return sequences, {len(state_keys)} key sequences and "
            f"{len(group_ids)} group ids; one of each per episode"
        )
    prompts = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    flat, anchors, lengths = [], [], []
    for g, ret, keys in zip(prompts, returns, state_keys, strict=True):
        if ret.dim() != 1 or ret.shape[0] != len(keys):
            raise ValueError(
                f"an episode has {tuple(ret.shape)} returns for {len(keys)} state keys; "
                "one return and one key per turn"
            )
        flat.append(upcast_float(ret))
        anchors += [(g, k) for k in keys]
        lengths.append(len(keys))
    if not anchors:
        return [torch.zeros(0) for _ in returns], {
            "step_groups": 0.0,
            "grouped_turn_fraction": 0.0,
            "step_group_size_mean": 0.0,
        }
    values = torch.cat(flat)
    result = grpo_advantages(values, anchors, norm_adv_by_std_in_grpo=norm_by_std, epsilon=epsilon)
    shared = [c for c in Counter(anchors).values() if c > 1]
    stats = {
        "step_groups": float(len(shared)),
        "grouped_turn_fraction": sum(shared) / len(anchors),
        "step_group_size_mean": sum(shared) / len(shared) if shared else 0.0,
    }
    return list(torch.split(result.advantages, lengths)), stats


def gigpo_advantages(
    rewards: Tensor,
    group_ids: GroupIds,
    *,
    turn_rewards: Sequence[Tensor],
    state_keys: Sequence[Sequence[Hashable]],
    gamma: float = 0.95,
    step_advantage_w: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    drop_zero_spread: bool = False,
) -> AdvantageResult:
    """Episode-level GRPO plus ``step_advantage_w`` times step-level advantages, per turn.

    Args:
        rewards: ``Float[N]`` episode rewards (the episode-level group compares these).
        group_ids: ``Long[N]`` or ``N`` hashables naming each episode's prompt.
        turn_rewards: per episode, ``Float[T_i]`` the reward of each turn.
        state_keys: per episode, ``T_i`` hashables naming the state each turn acted from.
        gamma: discount of the per-turn returns the step groups compare, in (0, 1].
        step_advantage_w: weight of the step-level advantage (0: GRPO, per turn).
        norm_adv_by_std_in_grpo: divide both levels by their group's std.
        drop_zero_spread: ``keep`` False for episodes of prompts whose episode rewards are
            all equal (their step advantages are then unused too).

    Returns:
        :class:`AdvantageResult` whose ``advantages`` are the episode level and whose
        ``turn_advantages`` are the combined per-turn advantages; ``stats`` holds the step
        groups' statistics (see :func:`step_advantages`).
    """
    episode = grpo_advantages(
        rewards,
        group_ids,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
        drop_zero_spread=drop_zero_spread,
    )
    returns = [discounted_returns(r, gamma) for r in turn_rewards]
    steps, stats = step_advantages(
        returns, state_keys, group_ids, norm_by_std=norm_adv_by_std_in_grpo, epsilon=epsilon
    )
    combined = tuple(
        episode.advantages[i] + step_advantage_w * s.to(episode.advantages.dtype)
        for i, s in enumerate(steps)
    )
    return AdvantageResult(
        advantages=episode.advantages,
        keep=episode.keep,
        num_groups=episode.num_groups,
        zero_spread_groups=episode.zero_spread_groups,
        turn_advantages=combined,
        stats=stats,
    )


@register_estimator("gigpo", needs={"turn_rewards", "state_keys"}, min_group_size=2)
def _gigpo(batch: EstimatorBatch, settings: EstimatorSettings) -> AdvantageResult:
    if batch.turn_rewards is None or batch.state_keys is None:
        raise ValueError("gigpo needs the batch's turn_rewards and state_keys")
    return gigpo_advantages(
        batch.rewards,
        batch.group_ids,
        turn_rewards=batch.turn_rewards,
        state_keys=batch.state_keys,
        gamma=setting(settings, "gigpo.gamma", 0.95),
        step_advantage_w=setting(settings, "gigpo.step_advantage_w", 1.0),
        norm_adv_by_std_in_grpo=setting(settings, "norm_adv_by_std_in_grpo", True),
        drop_zero_spread=setting(settings, "drop_zero_spread_groups", False),
    )


def turn_token_advantages(turn_adv: Tensor, loss_mask: Sequence[int]) -> Tensor:
    """Spread ``Float[T]`` per-turn advantages onto an episode's tokens -> ``Float[L]``.

    Each maximal run of 1s in ``loss_mask`` (length ``L``) is one turn's reply, in order;
    tokens off the mask get 0. Raises when the runs do not number ``T``.
    """
    mask = torch.as_tensor(list(loss_mask), dtype=torch.bool)
    # A reply begins where the mask turns on; its turn is the number of beginnings so far.
    begins = mask & ~torch.cat([torch.zeros(1, dtype=torch.bool), mask[:-1]])
    replies = int(begins.sum())
    if replies != turn_adv.shape[0]:
        raise ValueError(
            f"the loss mask holds {replies} replies for {turn_adv.shape[0]} turn advantages"
        )
    turn = (begins.cumsum(0) - 1).clamp_min(0)
    return torch.where(mask, turn_adv[turn] if replies else 0.0, 0.0).to(turn_adv.dtype)
