"""The playground of ``clew serve``: a page where a served model or adapter plays an env.

``GET /playground`` is a plain HTML and JavaScript page (``static/playground.html``, no
build step, nothing fetched from elsewhere). A browser cannot run the envs, so the server
holds them, behind a small JSON API the page calls beside OpenAI's endpoint:

* ``GET /playground/api/config``: the registered env ids (description, default options,
  accepted options) and the generation settings' defaults, those of ``clew play``'s flags;
* ``POST /playground/api/episodes`` ``{env_id, seed, options, generation}``: a new episode,
  its first observation (frames as PNG data URLs, text) and the chat-completions request
  for its first turn, but for ``model``;
* ``POST /playground/api/episodes/{id}/step`` ``{reply, finish_reason, prompt_tokens}``
  (or ``{context_full: true}``): the reply plays the turn; the answer has the action the
  env read, its reward and note, the next observation and the next turn's request (None
  once the episode is over, with its outcome: solved, failed or out of turns).

The page sends each request to ``POST /v1/chat/completions`` itself, as any client does,
with the model it picked. The episode is ``clew.agent.EpisodeTurns``, the very turn code of
``clew play`` (the rollouts' env side, prompt, image encoding, keep-last-K frames, reply
prefix and suffix, the env's own action parsing), so a page and ``clew play`` given the same
settings send the same requests and, greedy, play the same episode.

Episodes live in the server's memory, bounded: the least recently used are dropped past
``max_episodes``, and any idle for ``ttl_s``. Env options are JSON scalars, numbers of
magnitude at most ``MAX_OPTION_NUMBER``: one request must not make the server draw a frame
of gigapixels. With an API key set the API needs it as ``/v1`` does; the page itself is
open and asks for the key. The episodes are one process's: behind several Ray Serve
replicas a step may reach a replica that does not hold its episode (a 404), so a
playground is served by one replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field

from clew.agent import EpisodeTurns, Reply, chat_body, data_url
from clew.errors import ClewError
from clew.rollout.trajectory import Trajectory
from clew.serve.errors import BadRequest, ServeError

if TYPE_CHECKING:
    from clew.serve.server import Server

MAX_EPISODES = 64
EPISODE_TTL_S = 30 * 60.0
MAX_OPTION_NUMBER = 64
MAX_SEED = 2**63 - 1

OptionValue = Annotated[str, Field(max_length=200)] | bool | int | float | None
ShortText = Annotated[str, Field(max_length=1000)]


class Generation(BaseModel):
    """How replies are generated: ``clew play``'s flags (None: the flag's default)."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int | None = Field(None, ge=1, le=10_000)
    max_generate_length: int | None = Field(None, ge=1, le=1 << 20)
    max_input_length: int | None = Field(None, ge=1, le=1 << 24)
    reply_prefix: ShortText | None = None
    reply_suffix: ShortText | None = None
    allowed_tokens: ShortText | None = Field(
        None, description="comma-separated token texts, as --allowed-tokens"
    )
    keep_last_k_images: int | None = Field(None, ge=1, le=1024)
    temperature: float | None = Field(None, ge=0, le=100, allow_inf_nan=False)
    sampling_seed: int | None = Field(None, ge=0, le=MAX_SEED)


class NewEpisode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    env_id: str = Field(max_length=200, description="a registered env id (GET .../config)")
    seed: int = Field(ge=0, le=MAX_SEED, description="which episode of the env (the maze)")
    options: dict[Annotated[str, Field(max_length=100)], OptionValue] = Field(
        default_factory=dict, max_length=32, description="env options over the id's defaults"
    )
    generation: Generation = Field(default_factory=Generation)


class Step(BaseModel):
    """The model's reply to the last request, as the chat completion gave it."""

    model_config = ConfigDict(extra="forbid")

    reply: str | None = Field(None, max_length=1 << 20, description="choices[0].message.content")
    finish_reason: str = Field("stop", max_length=32, description="choices[0].finish_reason")
    prompt_tokens: int = Field(0, ge=0, le=1 << 40, description="usage.prompt_tokens")
    completion_tokens: int = Field(0, ge=0, le=1 << 40, description="usage.completion_tokens")
    context_full: bool = Field(
        False, description="the server refused the request as over its context"
    )


class _Recorder:
    """An env that keeps its last observation: the rollouts' turn code drops the one that
    ends an episode, and the page shows that frame too."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.last: Any = None
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def reset(self, seed: int, *args: Any, **kwargs: Any) -> Any:
        obs = self.env.reset(seed, *args, **kwargs)
        self.last, self.count = obs, self.count + 1
        return obs

    def step(self, action_text: str) -> Any:
        out = self.env.step(action_text)
        self.last, self.count = out[0], self.count + 1
        return out


@dataclass
class Episode:
    """One playground episode: its turns, its env and who may step it now."""

    turns: EpisodeTurns
    env: _Recorder
    max_turns: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    used: float = 0.0


class EpisodeStore:
    """Live episodes by id, least recently used first; at most ``capacity``, none idle for
    longer than ``ttl_s``."""

    def __init__(
        self,
        capacity: int = MAX_EPISODES,
        ttl_s: float = EPISODE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1 or ttl_s <= 0:
            raise ValueError(f"capacity must be >= 1 and ttl_s > 0, got {capacity}, {ttl_s}")
        self.capacity, self.ttl_s, self.clock = capacity, ttl_s, clock
        self._live: OrderedDict[str, Episode] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._live)

    def add(self, episode: Episode) -> str:
        self._expire()
        key = "ep-" + uuid.uuid4().hex
        episode.used = self.clock()
        self._live[key] = episode
        while len(self._live) > self.capacity:
            self._live.popitem(last=False)
        return key

    def get(self, key: str) -> Episode:
        self._expire()
        episode = self._live.get(key)
        if episode is None:
            raise ServeError(
                f"no playground episode {key!r}: it never existed or has expired (episodes "
                f"idle for {self.ttl_s / 60:g} minutes are dropped, and all but the "
                f"{self.capacity} most recently used); start one with POST "
                "/playground/api/episodes",
                status=404,
                code="episode_not_found",
            )
        self._live.move_to_end(key)
        episode.used = self.clock()
        return episode

    def _expire(self) -> None:
        oldest = self.clock() - self.ttl_s
        while self._live and next(iter(self._live.values())).used < oldest:
            self._live.popitem(last=False)


def outcome(traj: Trajectory) -> str:
    """How an ended episode reads on the page."""
    if traj.success:
        return "solved"
    return "out of turns" if traj.end_reason == "max_turns" else "failed"


def generation_defaults() -> dict[str, Any]:
    """The defaults of ``clew play``'s generation flags, which the page starts from."""
    from clew.commands.agent import add_generation_args

    parser = argparse.ArgumentParser(add_help=False)
    add_generation_args(parser)
    return {**vars(parser.parse_args([])), "sampling_seed": 0}


def env_catalog() -> list[dict[str, Any]]:
    from clew.envs import list_envs

    return [
        {
            "id": s.env_id,
            "description": s.description,
            "defaults": _plain(s.defaults),
            "options": sorted(s.accepted_options),
        }
        for s in list_envs()
    ]


def start_episode(body: NewEpisode) -> Episode:
    """The episode ``body`` asks for, reset and waiting for its first reply; ``BadRequest``
    naming what is accepted for an env id, options or settings it cannot have."""
    from clew.commands.agent import rollout_settings
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
                f"magnitude up to {MAX_OPTION_NUMBER}); play larger episodes with clew play",
                param=f"options.{key}",
            )
    try:
        env = _Recorder(make(body.env_id, **body.options))
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
    if turns.request is None:
        raise BadRequest(
            f"{body.env_id} could not start an episode of seed {body.seed}: {turns.traj.error}",
            param="seed",
        )
    return Episode(turns, env, min(settings.max_turns, env_max_turns))


def play_step(episode: Episode, body: Step) -> bool:
    """Play ``body``'s reply as the episode's next turn; whether a new frame was drawn."""
    if episode.turns.request is None:
        raise ServeError(
            "this episode is over: start a new one with POST /playground/api/episodes",
            status=409,
            code="episode_over",
        )
    if body.context_full:
        reply = None
    elif body.reply is None:
        raise BadRequest(
            "reply is required: the model's reply (choices[0].message.content), or "
            "context_full: true when the server refused the request as over its context",
            param="reply",
        )
    else:
        reply = Reply(body.reply, body.finish_reason == "stop", body.prompt_tokens, 0)
    drawn = episode.env.count
    try:
        episode.turns.answer(reply)
    except ClewError as err:  # max_input_length cannot hold the first turn
        raise BadRequest(str(err), param="generation.max_input_length") from None
    return episode.env.count > drawn


def view(key: str, episode: Episode, *, drawn: bool = True) -> dict[str, Any]:
    """What the page shows of ``episode`` and what it sends next."""
    turns, traj = episode.turns, episode.turns.traj
    request = turns.request
    done = request is None
    obs = episode.env.last if drawn else None
    info = traj.infos[-1] if traj.infos and traj.turns == len(traj.infos) else {}
    return {
        "id": key,
        "env_id": traj.env_id,
        "seed": traj.seed,
        "turn": traj.turns,
        "max_turns": episode.max_turns,
        "action": traj.actions[-1] if traj.actions else None,
        "reward": traj.reward,
        "event": _plain(info.get("event")),
        "note": _plain(info.get("note")),
        "observation": None
        if obs is None
        else {"text": obs.text, "images": [data_url(im) for im in obs.images]},
        "done": done,
        "outcome": outcome(traj) if done else None,
        "end_reason": traj.end_reason or None,
        "error": traj.error,
        "request": None
        if done
        else chat_body(
            request.messages,
            request.sampling,
            continue_final=request.continue_final,
            seed=request.seed,
        ),
    }


def playground_router(
    server: Server, *, max_episodes: int = MAX_EPISODES, ttl_s: float = EPISODE_TTL_S
) -> APIRouter:
    """The page and its API, for ``create_app`` to include."""
    store = EpisodeStore(max_episodes, ttl_s)
    router = APIRouter()

    @router.get("/playground", include_in_schema=False)
    async def page() -> HTMLResponse:
        html = resources.files("clew.serve").joinpath("static/playground.html").read_text()
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    @router.get("/playground/api/config")
    async def config() -> dict[str, Any]:
        return {
            "model_id": server.settings.model_id,
            "envs": await asyncio.to_thread(env_catalog),
            "generation": generation_defaults(),
            "max_images": server.settings.limits.max_images,
            "max_option_number": MAX_OPTION_NUMBER,
        }

    @router.post("/playground/api/episodes")
    async def new_episode(body: NewEpisode) -> dict[str, Any]:
        episode = await asyncio.to_thread(start_episode, body)
        key = store.add(episode)
        return await asyncio.to_thread(view, key, episode)

    @router.post("/playground/api/episodes/{episode_id}/step")
    async def step(episode_id: str, body: Step) -> dict[str, Any]:
        episode = store.get(episode_id)
        async with episode.lock:  # one turn at a time: a second step waits for the first
            drawn = await asyncio.to_thread(play_step, episode, body)
            return await asyncio.to_thread(view, episode_id, episode, drawn=drawn)

    return router


def _plain(value: Any) -> Any:
    """``value`` as plain JSON (an env's numpy scalars and tuples included)."""
    return json.loads(
        json.dumps(value, default=lambda x: x.item() if hasattr(x, "item") else str(x))
    )
