"""Episodes played through an endpoint, turn by turn, as the rollouts play them.

The env side is the rollouts' own code: ``start_episode`` makes and resets the env,
``RolloutSettings.reply_text`` puts the reply prefix and suffix around what the model
wrote, and ``take_turn`` steps the env and records the turn (reward, info, end reason,
turn budget, an env that raises). Only the model's side differs: each turn sends the
conversation so far (``clew.agent.messages``) to the endpoint instead of feeding a cache.

An episode ends as a rollout's does: on the env's done, on the turn budget, on an env
error, or with ``context_full`` when the next turn would not fit ``max_input_length`` (the
prompt the server counted plus ``max_tokens``, as the rollouts count it) or the server's
own context. Through an endpoint it may also end as ``server_error``: the server refused a
later turn's request or failed on it; the turns played so far stay, and ``error`` holds the
server's reason. A refusal of the first request is raised instead: nothing was played, and
the same settings would be refused in every episode.

Each request holds at most ``max_images`` images, the server's per-request limit: older
user turns are sent with their text alone, as ``keep_last_k_images`` does
(``clew.agent.messages``), when the episode's frames outgrow it. A refusal that names a
smaller limit is taken as the server's (``Endpoint.max_images``) and the turn is sent again
within it.

``EpisodeTurns`` is the episode as a state machine, one request at a time: whoever sends
the request (``play_episode`` through ``Endpoint``, or the playground page of ``clew
serve`` from a browser) hands back the reply, and the turn is played the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clew.agent.endpoint import ContextFull, Endpoint, Reply, RequestRefused, TooManyImages
from clew.agent.messages import Conversation
from clew.envs import make
from clew.errors import ConfigError
from clew.inference.sampling import SamplingParams
from clew.rollout.loop import RolloutSettings, fail_episode, start_episode, take_turn
from clew.rollout.trajectory import Trajectory


@dataclass(frozen=True)
class TurnRequest:
    """One turn's request: the conversation so far and how to sample the reply."""

    messages: list[dict[str, Any]]
    sampling: SamplingParams
    continue_final: bool  # the last message is the reply prefix, to continue
    seed: int | None  # sampled requests only: a seed that makes the run repeat


class EpisodeTurns:
    """One episode of ``env_id`` (reset to ``seed``), waiting for the replies to its requests.

    ``request`` is the next request to send, None once the episode ended (``traj`` says
    how). Sampled requests (temperature > 0) carry a seed derived from ``sampling_seed``,
    the episode and the turn, so a run repeats; greedy ones carry none. ``max_images``
    (None: no limit) is the most images a request may hold, the server's limit.
    """

    def __init__(
        self,
        env_id: str,
        options: dict[str, Any],
        seed: int,
        settings: RolloutSettings,
        *,
        group: int = 0,
        sample: int = 0,
        sampling_seed: int = 0,
        env_factory: Callable[..., Any] = make,
        max_images: int | None = None,
    ) -> None:
        self.env_id, self.seed, self.settings = env_id, seed, settings
        self._key = (sampling_seed, seed, group, sample)
        self.request: TurnRequest | None = None
        self.max_images = max_images
        # Whether a request left out frames that keep_last_k_images alone would have sent.
        self.images_left_out = False
        try:
            self._episode, obs = start_episode(env_id, options, seed, group, sample, env_factory)
        except Exception as exc:  # an env that cannot even reset is that episode's failure
            self.traj = Trajectory(env_id, options, seed, group, sample)
            fail_episode(self.traj, exc)
            return
        self.traj = self._episode.traj
        self.traj.image_window = settings.keep_last_k_images
        # The system prompt of the env's prompt format, as the rollouts open the episode.
        self.conversation = Conversation(system=getattr(obs, "system", None))
        self._ask(obs)

    def _ask(self, obs: Any) -> None:
        # The env's prompt format may put the text before the images (Observation).
        text_first = bool(getattr(obs, "text_first", False))
        self.conversation.add_observation(obs.text, obs.images, text_first=text_first)
        self._build()

    def _build(self) -> None:
        """The request for the turn after the conversation so far, within the image limit."""
        s = self.settings
        window = s.keep_last_k_images
        held = self.conversation.n_images()
        wanted = held if window is None else min(held, window)
        if self.max_images is not None and wanted > self.max_images:
            window, self.images_left_out = self.max_images, True
        messages = self.conversation.messages(
            reply_prefix=s.reply_prefix, keep_last_k_images=window
        )
        seed = None if s.sampling.greedy else _request_seed(*self._key, self.traj.turns)
        self.request = TurnRequest(messages, s.sampling, bool(s.reply_prefix), seed)

    def limit_images(self, max_images: int) -> bool:
        """Hold this and later requests to at most ``max_images`` images; whether the pending
        request had to be rebuilt for it (False: it was within the limit already)."""
        if self.request is None:
            raise RuntimeError("the episode is over: there is no request to rebuild")
        self.max_images = max_images
        if count_images(self.request.messages) <= max_images:
            return False
        self._build()
        return True

    def cut_short(self, reason: str) -> None:
        """End the episode unplayed past this turn: the server refused its request."""
        if self.request is None:
            raise RuntimeError("the episode is over: there is no request to refuse")
        self.request = None
        self.traj.end_reason = "server_error"
        self.traj.error = f"the server refused the request of turn {self.traj.turns + 1}: {reason}"

    def answer(self, reply: Reply | None) -> bool:
        """Play ``reply`` to ``request`` as the next turn; None: the server refused the
        request as longer than its context. False when the episode ended without playing
        it (``context_full``), True when it was played."""
        if self.request is None:
            raise RuntimeError("the episode is over: there is no request to answer")
        s, traj = self.settings, self.traj
        self.request = None
        if reply is None:
            traj.end_reason = "context_full"
            return False
        if reply.prompt_tokens + s.sampling.max_tokens > s.max_input_length:
            if traj.turns == 0:
                raise ConfigError(
                    f"max_input_length={s.max_input_length} cannot hold one turn: the "
                    f"first observation of {self.env_id} takes {reply.prompt_tokens} tokens "
                    f"and a reply up to {s.sampling.max_tokens}; raise max_input_length to at "
                    f"least {reply.prompt_tokens + s.sampling.max_tokens}"
                )
            traj.end_reason = "context_full"  # the rollouts would not have asked for this turn
            return False
        text = s.reply_text(reply.text, reply.stopped)
        self.conversation.add_reply(text)
        obs = take_turn(self._episode, text, s.max_turns)
        if obs is not None:
            self._ask(obs)
        return True


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

    ``on_turn`` sees the trajectory after every turn (``clew play`` prints it). Each request
    holds at most ``endpoint.max_images`` images; a later turn the server refuses ends the
    episode as ``server_error`` (see the module's docstring).
    """
    turns = EpisodeTurns(
        env_id,
        options,
        seed,
        settings,
        group=group,
        sample=sample,
        sampling_seed=sampling_seed,
        env_factory=env_factory,
        max_images=endpoint.max_images,
    )
    while turns.request is not None:
        limit = endpoint.max_images  # lowered by any episode of the run the server refused
        if limit is not None and limit != turns.max_images:
            turns.limit_images(limit)
        request = turns.request
        try:
            reply: Reply | None = endpoint.reply(
                request.messages,
                request.sampling,
                continue_final=request.continue_final,
                seed=request.seed,
            )
        except ContextFull:
            reply = None
        except TooManyImages as refused:
            limit = endpoint.max_images
            if limit is None or not turns.limit_images(limit):  # no smaller limit to keep
                _refused(turns, refused)
            continue  # else the same turn again, within the limit the server named
        except RequestRefused as refused:
            _refused(turns, refused)
            continue
        if turns.answer(reply) and on_turn is not None:
            on_turn(turns.traj)
    if turns.images_left_out:
        endpoint.images_left_out = True
    return turns.traj


def _refused(turns: EpisodeTurns, refused: RequestRefused) -> None:
    """End the episode with the server's reason, or raise the refusal of its first request."""
    if turns.traj.turns == 0:
        raise refused
    turns.cut_short(refused.reason)


def count_images(messages: list[dict[str, Any]]) -> int:
    """The image parts of a request's messages."""
    return sum(
        isinstance(part, dict) and part.get("type") == "image_url"
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
    )


def _request_seed(sampling_seed: int, seed: int, group: int, sample: int, turn: int) -> int:
    key = f"{sampling_seed}/{seed}/{group}/{sample}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1
