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

Each answer carries the episode's ``state``, which the page sends back with the next step,
so any replica behind Ray Serve can answer any step (``clew.serve.episodes``: the state
rebuilds an episode by replaying it, and a replica keeps the episodes it answered so that
it need not). An ended episode's answer says why it ended (``why``), and the page shows it.

Bounds (``clew.serve.playground_models``): env options are JSON scalars, numbers up to
``MAX_OPTION_NUMBER``; a frame has at most ``MAX_FRAME_PIXELS`` pixels and an episode at
most ``MAX_EPISODE_PIXELS`` (max turns times frame pixels), so a step costs the server
little, a replay included; env work runs on two threads of its own, beside the engine.
``keep_last_k_images`` defaults to the server's ``--max-images`` and may not exceed it, so
every turn's request fits the server's image limit, the oldest frames sent as their text
alone. With an API key set the API needs it as ``/v1`` does; the page is open and asks for
it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from clew.serve.episodes import (
    Episode,
    canonical,
    generation_defaults,
    outcome,
    plain_json,
    play_step,
    resume,
    start_episode,
    view,
)
from clew.serve.openapi import errors
from clew.serve.playground_models import (
    MAX_EPISODE_PIXELS,
    MAX_FRAME_PIXELS,
    MAX_OPTION_NUMBER,
    EpisodeState,
    NewEpisode,
    Step,
)
from clew.serve.protocol import invalid_text

if TYPE_CHECKING:
    from clew.serve.server import Server

__all__ = ["outcome", "playground_router"]

ENV_THREADS = 2


class EpisodeCache:
    """The episodes this replica answered, by their state's digest, least recently used
    dropped past ``max_episodes`` or ``max_bytes``; safe across threads."""

    def __init__(self, max_episodes: int = 64, max_bytes: int = 64 << 20) -> None:
        self.max_episodes, self.max_bytes = max_episodes, max_bytes
        self._held: OrderedDict[str, tuple[Episode, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, episode: Episode) -> None:
        size = episode.size()
        key = episode.env.digest.hexdigest()
        with self._lock:
            replaced = self._held.pop(key, None)
            self._bytes += size - (replaced[1] if replaced else 0)
            self._held[key] = (episode, size)
            while self._held and (
                len(self._held) > self.max_episodes or self._bytes > self.max_bytes
            ):
                _, (_, gone) = self._held.popitem(last=False)
                self._bytes -= gone

    def take(self, state: EpisodeState) -> Episode | None:
        """The episode answered with ``state``, removed (a step changes it), or None."""
        sent = canonical(state.model_dump(mode="json"))
        with self._lock:
            held = self._held.get(state.digest)
            if held is None or canonical(held[0].state()) != sent:
                return None  # not answered here, or not the state that was answered
            del self._held[state.digest]
            self._bytes -= held[1]
        return held[0]


def env_catalog() -> list[dict[str, Any]]:
    from clew.envs import list_envs

    return [
        {
            "id": s.env_id,
            "description": s.description,
            "defaults": plain_json(s.defaults),
            "options": sorted(s.accepted_options),
        }
        for s in list_envs()
    ]


def playground_router(server: Server) -> APIRouter:
    """The page and its API, for ``create_app`` to include."""
    router = APIRouter()
    cache = EpisodeCache()
    pool = ThreadPoolExecutor(ENV_THREADS, thread_name_prefix="clew-playground")
    max_images = server.settings.limits.max_images

    async def off_loop(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    @router.get("/playground", include_in_schema=False)
    async def page() -> HTMLResponse:
        html = resources.files("clew.serve").joinpath("static/playground.html").read_text()
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    @router.get("/playground/api/config", responses=errors(401, 500))
    async def config() -> dict[str, Any]:
        return {
            "model_id": server.settings.model_id,
            "envs": await asyncio.to_thread(env_catalog),
            "generation": generation_defaults(max_images),
            "max_images": max_images,
            "max_option_number": MAX_OPTION_NUMBER,
            "max_frame_pixels": MAX_FRAME_PIXELS,
            "max_episode_pixels": MAX_EPISODE_PIXELS,
        }

    @router.post("/playground/api/episodes", responses=errors(400, 401, 413, 500))
    async def new_episode(body: NewEpisode) -> dict[str, Any]:
        if (bad := invalid_text(body)) is not None:
            raise bad

        def run() -> dict[str, Any]:
            episode = start_episode(body, max_images)
            answer = view(episode)
            cache.put(episode)
            return answer

        return await off_loop(run)

    @router.post("/playground/api/episodes/step", responses=errors(400, 401, 409, 413, 500))
    async def step(body: Step) -> dict[str, Any]:
        if (bad := invalid_text(body)) is not None:
            raise bad

        def run() -> dict[str, Any]:
            episode = cache.take(body.state) or resume(body.state, max_images)
            answer = view(episode, drawn=play_step(episode, body))
            cache.put(episode)
            return answer

        return await off_loop(run)

    return router
