"""The playground of ``clew serve``: a page where a served model or adapter plays an env.

``GET /playground`` is a plain HTML and JavaScript page (``static/playground.html``, no
build step, nothing fetched from elsewhere). A browser cannot run the envs, so the server
runs them, behind a small JSON API the page calls beside OpenAI's endpoint:

* ``GET /playground/api/config``: the registered envs (description, default and accepted
  options) and the defaults of ``clew play``'s generation flags;
* ``POST /playground/api/episodes`` ``{env_id, seed, options, generation}``: a new
  episode's first observation (frames as PNG data URLs, text), its first turn's
  chat-completions request (but for ``model``) and its ``state``;
* ``POST /playground/api/episodes/step`` ``{state, reply, finish_reason, prompt_tokens}``
  (or ``{state, context_full: true}``): the reply plays the turn; the answer has the action
  the env read, its reward and note, the next observation and request (None once over,
  with the outcome: solved, failed or out of turns) and the new ``state``.

The page sends each request to ``POST /v1/chat/completions`` itself, with the model it
picked. The episode is ``clew.agent.EpisodeTurns``, the turn code of ``clew play``, so a
page and ``clew play`` given the same settings send the same requests and, greedy, play the
same episode.

The server keeps no episode, so any replica behind Ray Serve can answer any step. ``state``
rebuilds one: env id, options, seed, generation settings and the history (each reply the
env took, with its finish reason). The page sends the last answer's state back with each
step; the server resets the env with the seed, replays the history through
``EpisodeTurns`` and plays the new reply. That relies on the envs being deterministic given
their seed and actions, as those of clew's registry are. ``state.digest`` checks it: a hash
of the settings and of every reply and observation so far, which the replay must
reproduce, or the step is a 409 (``history_diverged``: a changed history, or an env that
drew something else this time) rather than another maze played on. A consistency check, not
a signature: whoever could forge a state could as well start that episode. The history is
at most the episode's max turns. An episode ended by the context (``context_full``) took no
reply: its state is the one before, and a step with it plays that turn again.

Env options are JSON scalars, numbers up to ``MAX_OPTION_NUMBER`` (no frame of gigapixels).
With an API key set the API needs it as ``/v1`` does; the page is open and asks for it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
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

MAX_OPTION_NUMBER = 64
MAX_SEED = 2**63 - 1
MAX_HISTORY = 10_000  # the schema's bound; an episode's own max turns is the real one
NEW_EPISODE = "start a new one with POST /playground/api/episodes"

OptionValue = Annotated[str, Field(max_length=200)] | bool | int | float | None
ShortText = Annotated[str, Field(max_length=1000)]
ReplyText = Annotated[str, Field(max_length=1 << 20)]
FinishReason = Annotated[str, Field(max_length=32)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Generation(_Body):
    """How replies are generated: ``clew play``'s flags (None: the flag's default)."""

    max_turns: int | None = Field(None, ge=1, le=MAX_HISTORY)
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


class NewEpisode(_Body):
    env_id: str = Field(max_length=200, description="a registered env id (GET .../config)")
    seed: int = Field(ge=0, le=MAX_SEED, description="which episode of the env (the maze)")
    options: dict[Annotated[str, Field(max_length=100)], OptionValue] = Field(
        default_factory=dict, max_length=32, description="env options over the id's defaults"
    )
    generation: Generation = Field(default_factory=Generation)


class Played(_Body):
    """A reply the env has taken: the model's text and how its generation ended."""

    reply: ReplyText
    finish_reason: FinishReason = "stop"


class EpisodeState(NewEpisode):
    """An episode as the page holds it: the answer's ``state``, sent back with each step."""

    history: list[Played] = Field(
        default_factory=list, max_length=MAX_HISTORY, description="the replies played, in order"
    )
    digest: str = Field(
        pattern=r"^[0-9a-f]{32}$", description="the state's digest, as the server returned it"
    )


class Step(_Body):
    """The model's reply to the last request, as the chat completion gave it, and its state."""

    state: EpisodeState
    reply: ReplyText | None = Field(None, description="choices[0].message.content")
    finish_reason: FinishReason = Field("stop", description="choices[0].finish_reason")
    prompt_tokens: int = Field(0, ge=0, le=1 << 40, description="usage.prompt_tokens")
    completion_tokens: int = Field(0, ge=0, le=1 << 40, description="usage.completion_tokens")
    context_full: bool = Field(
        False, description="the server refused the request as over its context"
    )


class _Recorder:
    """An env that keeps its last observation (the rollouts' turn code drops the one that
    ends an episode, and the page shows that frame too) and adds each to ``digest``."""

    def __init__(self, env: Any, digest: Any) -> None:
        self.env, self.digest = env, digest
        self.last: Any = None
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def reset(self, seed: int, *args: Any, **kwargs: Any) -> Any:
        self._saw(obs := self.env.reset(seed, *args, **kwargs))
        return obs

    def step(self, action_text: str) -> Any:
        self._saw((out := self.env.step(action_text))[0])
        return out

    def _saw(self, obs: Any) -> None:
        self.last, self.count = obs, self.count + 1
        _fold(self.digest, obs.text.encode("utf-8", "surrogatepass"))
        for image in obs.images:
            _fold(self.digest, f"{image.mode} {image.size}".encode())
            _fold(self.digest, image.tobytes())


@dataclass
class Episode:
    """One playground episode, rebuilt for one request: its turns, its env, the replies it
    took and the running digest of them and what the env drew."""

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
    spec_json = body.model_dump(mode="json", include=set(NewEpisode.model_fields))
    digest = hashlib.blake2b(digest_size=16)
    _fold(digest, json.dumps(_canonical(spec_json), sort_keys=True).encode())
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
    if turns.request is None:
        raise BadRequest(
            f"{body.env_id} could not start an episode of seed {body.seed}: {turns.traj.error}",
            param="seed",
        )
    return Episode(spec_json, turns, env, min(settings.max_turns, env_max_turns))


def resume(state: EpisodeState) -> Episode:
    """The episode ``state`` describes, rebuilt by replaying its history; a 409 when the
    replay does not reach the state the server answered with."""
    try:
        episode = start_episode(state)
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
        "state": episode.state(),
    }


def playground_router(server: Server) -> APIRouter:
    """The page and its API, for ``create_app`` to include."""
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
        return await asyncio.to_thread(view, episode)

    @router.post("/playground/api/episodes/step")
    async def step(body: Step) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            episode = resume(body.state)
            return view(episode, drawn=play_step(episode, body))

        return await asyncio.to_thread(run)

    return router


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


def _canonical(value: Any) -> Any:
    """``value`` with whole floats as ints: a browser's JSON writes 2.0 back as 2."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _plain(value: Any) -> Any:
    """``value`` as plain JSON (an env's numpy scalars and tuples included)."""
    return json.loads(
        json.dumps(value, default=lambda x: x.item() if hasattr(x, "item") else str(x))
    )
