"""Playground episodes: started, rebuilt from their state, stepped and shown
(``clew.serve.playground`` is their HTTP API).

The server needs no memory of an episode: ``state`` rebuilds one (env id, options, seed,
generation settings and the history of replies the env took, with their finish reasons).
``resume`` resets the env with the seed and replays the history through ``EpisodeTurns``,
which relies on the envs being deterministic given their seed and actions, as those of
clew's registry are. ``state.digest`` checks it: a hash of the settings and of every reply
and observation so far, which the replay must reproduce, or the step is a 409
(``history_diverged``: a changed history, or an env that drew something else this time)
rather than another maze played on. A consistency check, not a signature: whoever could
forge a state could as well start that episode. An episode ended by the context
(``context_full``) took no reply: its state is the one before, and a step with it plays
that turn again.

A replay costs every frame so far, so a replica keeps the episodes it answered
(``clew.serve.playground.EpisodeCache``) and steps one from there when the state it is
sent is the one it answered with; any other replica, or this one after the episode left
its cache, replays. Either way a step gives the same answer, and the bounds on frames
(``clew.serve.playground_models``) bound a replay.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from clew.agent import EpisodeTurns, Reply, chat_body, data_url
from clew.errors import ClewError
from clew.rollout.trajectory import Trajectory
from clew.serve.openai_errors import BadRequest, ServeError
from clew.serve.playground_models import (
    MAX_EPISODE_PIXELS,
    MAX_FRAME_PIXELS,
    MAX_OPTION_NUMBER,
    EpisodeState,
    NewEpisode,
    Played,
    Step,
)

NEW_EPISODE = "start a new one with POST /playground/api/episodes"
LARGER = "play larger episodes with clew play"


class _Recorder:
    """An env that keeps its last observation (the rollouts' turn code drops the one that
    ends an episode, and the page shows that frame too), adds each to ``digest`` and
    refuses frames over ``MAX_FRAME_PIXELS`` before they are encoded."""

    def __init__(self, env: Any, digest: Any) -> None:
        self.env, self.digest = env, digest
        self.last: Any = None
        self.count = 0
        self.pixels = 0  # of the last observation's images
        self.refused: BadRequest | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def reset(self, seed: int, *args: Any, **kwargs: Any) -> Any:
        self._saw(obs := self.env.reset(seed, *args, **kwargs))
        return obs

    def step(self, action_text: str) -> Any:
        self._saw((out := self.env.step(action_text))[0])
        return out

    def _saw(self, obs: Any) -> None:
        self.pixels = sum(im.size[0] * im.size[1] for im in obs.images)
        if self.pixels > MAX_FRAME_PIXELS:
            sizes = ", ".join(f"{im.size[0]} x {im.size[1]}" for im in obs.images)
            self.refused = BadRequest(
                f"options: these options draw frames of {sizes} pixels, over the playground's "
                f"limit of {MAX_FRAME_PIXELS:,} pixels a turn; lower grid_size or cell_px, or "
                f"{LARGER}",
                param="options",
                code="episode_too_large",
            )
            raise self.refused
        self.last, self.count = obs, self.count + 1
        _fold(self.digest, obs.text.encode("utf-8", "surrogatepass"))
        for image in obs.images:
            _fold(self.digest, f"{image.mode} {image.size}".encode())
            _fold(self.digest, image.tobytes())


@dataclass
class Episode:
    """One playground episode: its turns, its env, the replies it took and the running
    digest of them and what the env drew."""

    spec: dict[str, Any]  # env id, seed, options and generation, as JSON
    turns: EpisodeTurns
    env: _Recorder
    max_turns: int
    history: list[Played] = field(default_factory=list)

    def take(self, played: Played, prompt_tokens: int = 0) -> bool:
        """Play ``played`` as the next turn; whether a new frame was drawn."""
        reply = Reply(played.reply, played.finish_reason == "stop", prompt_tokens, 0)
        drawn = self.env.count
        try:
            taken = self.turns.answer(reply)
        except ClewError as err:  # max_input_length cannot hold the first turn
            raise BadRequest(str(err), param="generation.max_input_length") from None
        if taken:  # a reply refused as over max_input_length ended it unplayed
            self.history.append(played)
            _fold(self.env.digest, played.reply.encode("utf-8", "surrogatepass"))
            _fold(self.env.digest, played.finish_reason.encode())
        return self.env.count > drawn

    def state(self) -> dict[str, Any]:
        return {
            **self.spec,
            "history": [p.model_dump() for p in self.history],
            "digest": self.env.digest.hexdigest(),
        }

    def size(self) -> int:
        """About the bytes it holds: its frames, as the data URLs of its requests."""
        conversation = getattr(self.turns, "conversation", None)
        turns = getattr(conversation, "turns", [])
        held = sum(len(u) for role, c in turns if role == "user" for u in c[1])
        return held + 1024 * (1 + len(self.history))


def outcome(traj: Trajectory) -> str:
    """How an ended episode reads on the page."""
    if traj.success:
        return "solved"
    return "out of turns" if traj.end_reason == "max_turns" else "failed"


def why_it_ended(traj: Trajectory, max_turns: int) -> str:
    """A sentence for the page: why the episode ended."""
    n = f"{traj.turns} turn{'' if traj.turns == 1 else 's'}"
    reason = traj.end_reason
    if traj.success:
        return f"solved in {n}"
    if reason == "max_turns":
        return f"out of turns: {max_turns} turns played without reaching the goal"
    if reason == "context_full":
        return (
            f"stopped after {n}: the next turn would not fit the context (generation "
            "max_input_length, or the server's --max-model-len)"
        )
    if reason in ("env_error", "server_error"):
        who = "the env failed" if reason == "env_error" else "the server refused a turn"
        return f"stopped after {n}: {who}: {traj.error}"
    return f"failed after {n}: the episode ended ({reason or 'done'})"


def generation_defaults(max_images: int | None = None) -> dict[str, Any]:
    """The defaults of ``clew play``'s generation flags, which the page starts from; with
    ``max_images``, ``keep_last_k_images`` defaults to it (the server's image limit)."""
    from clew.agent.flags import add_generation_args

    parser = argparse.ArgumentParser(add_help=False)
    add_generation_args(parser)
    defaults = {**vars(parser.parse_args([])), "sampling_seed": 0}
    if max_images is not None and defaults.get("keep_last_k_images") is None:
        defaults["keep_last_k_images"] = max_images
    return defaults


def start_episode(body: NewEpisode, max_images: int) -> Episode:
    """The episode ``body`` asks for, reset and waiting for its first reply; ``BadRequest``
    naming what is accepted for an env id, options or settings it cannot have.

    ``max_images``: the server's images per request; ``keep_last_k_images`` defaults to it
    and may not exceed it, so that no turn's request is refused for its images."""
    from clew.agent.flags import rollout_settings
    from clew.envs import make, spec

    try:
        accepted = spec(body.env_id).accepted_options
    except ClewError as err:
        raise BadRequest(str(err), param="env_id") from None
    for key, value in body.options.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and not (math.isfinite(value) and abs(value) <= MAX_OPTION_NUMBER):
            raise BadRequest(
                f"options.{key}: {value!r} is out of the playground's range (numbers of "
                f"magnitude up to {MAX_OPTION_NUMBER}); {LARGER}",
                param=f"options.{key}",
            )
    window = body.generation.keep_last_k_images
    if window is not None and window > max_images:
        raise BadRequest(
            f"generation.keep_last_k_images: {window} is over this server's limit of "
            f"{max_images} images per request (--max-images); keep at most {max_images}",
            param="generation.keep_last_k_images",
        )
    if window is None:
        generation = body.generation.model_copy(update={"keep_last_k_images": max_images})
        body = body.model_copy(update={"generation": generation})
    spec_json = body.model_dump(mode="json", include=set(NewEpisode.model_fields))
    digest = hashlib.blake2b(digest_size=16)
    _fold(digest, json.dumps(canonical(spec_json), sort_keys=True).encode())
    try:
        env = _Recorder(make(body.env_id, **body.options), digest)
    except ClewError as err:  # the env's own check of its options
        raise BadRequest(f"options: {err}", param="options") from None
    except Exception as err:  # an option of the wrong type the env did not check
        raise BadRequest(
            f"options: {body.env_id} cannot be made with {body.options} ({type(err).__name__}: "
            f"{err}); accepted options: {', '.join(sorted(accepted))}",
            param="options",
        ) from None
    env_max_turns = int(getattr(env, "max_turns", 1 << 30))
    args = argparse.Namespace(**generation_defaults())
    for key, value in body.generation.model_dump(exclude_none=True).items():
        setattr(args, key, value)
    try:
        settings = rollout_settings(args, env_max_turns)
    except ClewError as err:
        raise BadRequest(f"generation: {err}", param="generation") from None
    turns = EpisodeTurns(
        body.env_id,
        body.options,
        body.seed,
        settings,
        sampling_seed=args.sampling_seed,
        env_factory=lambda *_, **__: env,
    )
    if env.refused is not None:
        raise env.refused
    if turns.request is None:
        raise BadRequest(
            f"{body.env_id} could not start an episode of seed {body.seed}: {turns.traj.error}",
            param="seed",
        )
    max_turns = min(settings.max_turns, env_max_turns)
    if env.pixels * max_turns > MAX_EPISODE_PIXELS:
        raise BadRequest(
            f"an episode of {max_turns} turns of {env.pixels:,}-pixel frames is over the "
            f"playground's limit of {MAX_EPISODE_PIXELS:,} pixels an episode; lower "
            f"generation.max_turns (to {max(1, MAX_EPISODE_PIXELS // env.pixels)} or fewer), "
            f"grid_size or cell_px, or {LARGER}",
            param="generation.max_turns",
            code="episode_too_large",
        )
    return Episode(spec_json, turns, env, max_turns)


def resume(state: EpisodeState, max_images: int) -> Episode:
    """The episode ``state`` describes, rebuilt by replaying its history; a 409 when the
    replay does not reach the state the server answered with."""
    try:
        episode = start_episode(state, max_images)
    except BadRequest as err:  # the page sent these settings as its state's
        err.param = f"state.{err.param}" if err.param else "state"
        raise
    if len(state.history) > episode.max_turns:
        raise BadRequest(
            f"state.history has {len(state.history)} replies; this episode takes at most "
            f"{episode.max_turns} (its max turns)",
            param="state.history",
        )
    for played in state.history:
        if episode.turns.request is None:
            raise _diverged(state, "its history goes on past the episode's end")
        episode.take(played)
    if episode.env.digest.hexdigest() != state.digest:
        raise _diverged(state, "the replay does not match the episode the server answered")
    return episode


def play_step(episode: Episode, body: Step) -> bool:
    """Play ``body``'s reply as the episode's next turn; whether a new frame was drawn."""
    if episode.turns.request is None:
        raise ServeError(f"this episode is over: {NEW_EPISODE}", status=409, code="episode_over")
    if body.context_full:
        episode.turns.answer(None)
        return False
    if body.reply is None:
        raise BadRequest(
            "reply is required: the model's reply (choices[0].message.content), or "
            "context_full: true when the server refused the request as over its context",
            param="reply",
        )
    played = Played(reply=body.reply, finish_reason=body.finish_reason)
    return episode.take(played, body.prompt_tokens)


def view(episode: Episode, *, drawn: bool = True) -> dict[str, Any]:
    """What the page shows of ``episode`` and what it sends next."""
    request, traj = episode.turns.request, episode.turns.traj
    done = request is None
    obs = episode.env.last if drawn else None
    info = traj.infos[-1] if traj.infos and traj.turns == len(traj.infos) else {}
    return {
        "env_id": traj.env_id,
        "seed": traj.seed,
        "turn": traj.turns,
        "max_turns": episode.max_turns,
        "action": traj.actions[-1] if traj.actions else None,
        "reward": traj.reward,
        "event": plain_json(info.get("event")),
        "note": plain_json(info.get("note")),
        "observation": None
        if obs is None
        else {"text": obs.text, "images": [data_url(im) for im in obs.images]},
        "done": done,
        "outcome": outcome(traj) if done else None,
        "end_reason": traj.end_reason or None,
        "why": why_it_ended(traj, episode.max_turns) if done else None,
        "error": traj.error,
        "request": None
        if done
        else chat_body(
            request.messages,
            request.sampling,
            continue_final=request.continue_final,
            seed=request.seed,
        ),
        "state": episode.state(),
    }


def _diverged(state: EpisodeState, why: str) -> ServeError:
    return ServeError(
        f"this episode's state does not replay ({why}): its history or settings were "
        f"changed, or {state.env_id} did not repeat itself given its seed and replies; "
        f"{NEW_EPISODE}",
        status=409,
        code="history_diverged",
    )


def _fold(digest: Any, part: bytes) -> None:
    """Add ``part`` to ``digest``, length first, so that no two sequences of parts collide."""
    digest.update(len(part).to_bytes(8, "big"))
    digest.update(part)


def canonical(value: Any) -> Any:
    """``value`` with whole floats as ints: a browser's JSON writes 2.0 back as 2."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def plain_json(value: Any) -> Any:
    """``value`` as plain JSON (an env's numpy scalars and tuples included)."""
    return json.loads(
        json.dumps(value, default=lambda x: x.item() if hasattr(x, "item") else str(x))
    )
