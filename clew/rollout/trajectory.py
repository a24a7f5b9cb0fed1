"""What one played episode leaves behind, exactly as the model saw and sampled it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from clew.models.chat import ChatFormat, Chunk
from clew.models.pixels import Frames

if TYPE_CHECKING:
    from clew.envs.base import Observation

END_REASONS = ("stop", "reached_goal", "max_turns", "context_full", "cache_budget", "env_error")


@dataclass
class Trajectory:
    """One episode: the full token sequence, which tokens the model generated, and the outcome.

    ``loss_mask[i]`` is 1 exactly on tokens the model sampled; ``logprobs[i]`` is the
    sampling logprob there and 0 elsewhere. Pixels are not kept (they are ~10x the size of
    the images): ``vision_inputs`` re-encodes ``images``, which gives the same tensors.
    ``frames`` keeps the engine's byte encoding of the images (``Frames``, the images' own
    size; training rollouts only, ``RolloutSettings.keep_frames``) so that training in the
    same process reads them instead of encoding the images again; a pickled trajectory
    (another process, a Ray actor) leaves them out and is encoded there, so what travels is
    what travelled without them.
    """

    env_id: str
    env_options: dict[str, Any]
    seed: int
    group_id: int
    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    images: list[Image.Image] = field(default_factory=list)
    chunk_starts: list[int] = field(default_factory=list)  # where each observation begins
    image_window: int | None = None  # generator.keep_last_k_images the episode ran with
    # Per observation with images, the engine's ``Frames`` of them (``encode_vision``).
    frames: list[Frames] = field(default_factory=list, repr=False)
    wave: int = 0  # which engine batch of its rollout it ran in, from 0 (the KV cache budget)
    actions: list[str] = field(default_factory=list)
    # Per turn: the reward env.step returned, and the state the reply acted from
    # (observation_key of the observation before it), for estimators that credit turns (gigpo).
    turn_rewards: list[float] = field(default_factory=list)
    # (A rollout records the env's state names, or PendingKey entries that it hashes when it
    # ends: hash_state_keys.)
    state_keys: list[str] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    # The env's own reward at the end when a reward rule (clew.envs.rewards) reshaped
    # ``reward``; None when ``reward`` is the env's own. ``success`` reads it.
    task_reward: float | None = None
    turns: int = 0
    end_reason: str = ""
    error: str | None = None

    def add_observation(
        self,
        chunk: Chunk,
        images: list[Image.Image],
        state: str | PendingKey | None = None,
        frames: bool = False,
    ) -> None:
        """Append an observation; ``frames``: keep the chunk's ``Frames`` of its images."""
        if state is not None:
            self.state_keys.append(state)
        self.chunk_starts.append(len(self.token_ids))
        self.token_ids += chunk.token_ids
        self.loss_mask += [0] * len(chunk.token_ids)
        self.logprobs += [0.0] * len(chunk.token_ids)
        self.images += images
        if (
            frames
            and isinstance(chunk.pixel_values, Frames)
            and len(chunk.pixel_values) == len(images)
        ):
            self.frames.append(chunk.pixel_values)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"frames": []}

    def add_reply(self, token_ids: list[int], logprobs: list[float]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.logprobs += logprobs

    def padded_turn_rewards(self) -> list[float]:
        """``turn_rewards`` with one entry per turn (0 for a turn whose env step raised)."""
        return self.turn_rewards + [0.0] * (self.turns - len(self.turn_rewards))

    @property
    def success(self) -> bool:
        """Whether the env paid its task reward (the maze: stopped on the goal), whatever a
        reward rule added on top (format credit earns reward without success)."""
        task = self.reward if self.task_reward is None else self.task_reward
        return task > 0

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def parse_errors(self) -> int:
        return sum(1 for i in self.infos if i.get("parse_error"))

    def vision_inputs(self, chat: ChatFormat) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``pixel_values`` and ``image_grid_thw`` of every image in the sequence, in order."""
        if not self.images:
            return None, None
        return chat.encode_images(self.images)

    def record(self) -> dict[str, Any]:
        """A JSON-ready summary (no pixels): enough to replay and render the episode."""
        return {
            "env_id": self.env_id,
            "env_options": self.env_options,
            "seed": self.seed,
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "actions": self.actions,
            "reward": self.reward,
            "task_reward": self.reward if self.task_reward is None else self.task_reward,
            "success": self.success,
            "turns": self.turns,
            "end_reason": self.end_reason,
            "error": self.error,
            "tokens": len(self.token_ids),
            "generated_tokens": self.generated_tokens,
            "parse_errors": self.parse_errors,
            "events": [i.get("event") for i in self.infos],
            "optimal_turns": self.infos[0].get("optimal_turns") if self.infos else None,
        }


@dataclass(frozen=True)
class PendingKey:
    """What an observation's state key is made of, hashed later (``hash_state_keys``)."""

    images: list[Image.Image]
    text: str


def observation_key(obs: Observation) -> str | PendingKey:
    """The state key of ``obs``: the env's name for its state where it gives one
    (``Observation.state``), else its frames' digest, computed later (``hash_state_keys``)."""
    return obs.state if obs.state is not None else PendingKey(obs.images, obs.text)


def hash_state_keys(trajs: Sequence[Trajectory], map_: Callable[..., Iterable[str]]) -> None:
    """Replace every ``PendingKey`` in ``trajs``' state keys by its ``state_key``, computed
    with ``map_`` (a thread pool's: SHA-256 releases the GIL over a frame's bytes, so a
    rollout's frames hash in parallel, after its turns rather than between them)."""
    pending = [
        (t, i, k) for t in trajs for i, k in enumerate(t.state_keys) if isinstance(k, PendingKey)
    ]
    keys = map_(lambda p: state_key(p[2].images, p[2].text), pending)
    for (t, i, _), key in zip(pending, keys, strict=True):
        t.state_keys[i] = key


def state_key(images: list[Image.Image], text: str) -> str:
    """A digest naming the state an observation shows: its images' pixels, else its text.

    The images alone when there are any: the maze's text says which turn it is and what
    the last move did, so two visits of one cell differ in text but not in the frame, and
    the frame is the state. Equal keys within a prompt's group form GiGPO's step groups.
    """
    # SHA-256 rather than BLAKE2: CPUs with SHA extensions hash a frame about twice as fast,
    # and a GiGPO rollout hashes every frame of every turn on the host.
    h = hashlib.sha256()
    if images:
        for im in images:
            h.update(f"{im.mode}{im.size}".encode())
            h.update(im.tobytes())
    else:
        h.update(text.encode())
    return h.hexdigest()[:32]


def apply_reward_rule(trajs: list[Trajectory], rule: str) -> None:
    """Score finished ``trajs`` by the reward rule ``rule`` (``clew.envs.rewards``): each
    keeps the env's reward as ``task_reward`` and gets the rule's as ``reward`` and as its
    last turn's reward (the rule pays once, at the end). ``task`` changes nothing; an
    episode with no reply (its env failed at reset) keeps its reward."""
    if rule == "task":
        return
    from clew.envs.rewards import trajectory_reward

    for traj in trajs:
        if not traj.actions or traj.task_reward is not None:
            continue
        traj.task_reward = traj.reward
        traj.reward = trajectory_reward(rule, traj.reward, traj.actions)
        if traj.turn_rewards:
            traj.turn_rewards[-1] = traj.reward
