"""Episodes played through an endpoint, turn by turn, as the rollouts play them.

The env side is the rollouts' own code: ``start_episode`` makes and resets the env,
``RolloutSettings.reply_text`` puts the reply prefix and suffix around what the model
wrote, and ``take_turn`` steps the env and records the turn (reward, info, end reason,
turn budget, an env that raises). Only the model's side differs: each turn sends the
conversation so far (``clew.agent.messages``) to the endpoint instead of feeding a cache.

An episode ends as a rollout's does: on the env's done, on the turn budget, on an env
error, or with ``context_full`` when the next turn would not fit ``max_input_length`` (the
prompt the server counted plus ``max_tokens``, as the rollouts count it) or the server's
own context.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from clew.agent.endpoint import ContextFull, Endpoint
from clew.agent.messages import Conversation
from clew.envs import make
from clew.errors import ConfigError
from clew.rollout.loop import RolloutSettings, fail_episode, start_episode, take_turn
from clew.rollout.trajectory import Trajectory


def play_episode(
    endpoint: Endpoint,
    env_id: str,
    options: dict[str, Any],
    seed: int,
    settings: RolloutSettings,
    *,
    group: int = 0,
    sample: int = 0,
    sampling_seed: int = 0,
    env_factory: Callable[..., Any] = make,
    on_turn: Callable[[Trajectory], None] | None = None,
) -> Trajectory:
    """Play one episode of ``env_id`` (reset to ``seed``) with the endpoint's model.

    ``on_turn`` sees the trajectory after every turn (``clew play`` prints it). Sampled
    requests (temperature > 0) carry a seed derived from ``sampling_seed``, the episode
    and the turn, so a run repeats; greedy ones carry none.
    """
    try:
        ep, obs = start_episode(env_id, options, seed, group, sample, env_factory)
    except Exception as exc:  # an env that cannot even reset is that episode's failure
        traj = Trajectory(env_id, options, seed, group, sample)
        fail_episode(traj, exc)
        return traj
    traj = ep.traj
    traj.image_window = settings.keep_last_k_images
    conversation = Conversation()
    sampling = settings.sampling
    while True:
        conversation.add_observation(obs.text, obs.images)
        messages = conversation.messages(
            reply_prefix=settings.reply_prefix, keep_last_k_images=settings.keep_last_k_images
        )
        request_seed = (
            None
            if sampling.greedy
            else _request_seed(sampling_seed, seed, group, sample, traj.turns)
        )
        try:
            reply = endpoint.reply(
                messages,
                sampling,
                continue_final=bool(settings.reply_prefix),
                seed=request_seed,
            )
        except ContextFull:
            traj.end_reason = "context_full"
            return traj
        if reply.prompt_tokens + sampling.max_tokens > settings.max_input_length:
            if traj.turns == 0:
                raise ConfigError(
                    f"max_input_length={settings.max_input_length} cannot hold one turn: the "
                    f"first observation of {env_id} takes {reply.prompt_tokens} tokens and a "
                    f"reply up to {sampling.max_tokens}; raise max_input_length to at least "
                    f"{reply.prompt_tokens + sampling.max_tokens}"
                )
            traj.end_reason = "context_full"  # the rollouts would not have asked for this turn
            return traj
        text = settings.reply_text(reply.text, reply.stopped)
        conversation.add_reply(text)
        obs = take_turn(ep, text, settings.max_turns)
        if on_turn is not None:
            on_turn(traj)
        if obs is None:
            return traj


def _request_seed(sampling_seed: int, seed: int, group: int, sample: int, turn: int) -> int:
    key = f"{sampling_seed}/{seed}/{group}/{sample}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1
