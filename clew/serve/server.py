"""The server's parts put together: the base policy, its engine, adapters and scheduler.

``Server`` is what the HTTP app (``clew.serve.app``) calls: it resolves model names
(``ID`` for the base, ``ID:NAME`` for the adapter under the prefix), turns a validated
request into a ``GenerationRequest`` (the prompt encoded off the event loop) and hands it
to the ``Scheduler``. ``run_server`` serves it with uvicorn until SIGINT/SIGTERM, then
shuts down within ``--shutdown-timeout`` (``run_server``).

Metric labels name only what the server serves: ``base``, and adapters once loaded; any
other name a client sends counts under ``unknown`` (``label``), so clients cannot grow the
label set.

Prompts are encoded on a small thread pool, each thread with its own copy of the processor:
the scheduler's thread decodes with the engine's tokenizer meanwhile, and a Rust tokenizer
shared between threads can fail with "Already borrowed".
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from clew.errors import ClewError
from clew.inference.engine import InferenceEngine
from clew.models.chat import ChatFormat
from clew.serve.adapter_pool import LoadedAdapters
from clew.serve.adapter_store import AdapterStore, check_name
from clew.serve.openai_errors import AdapterUnavailable, BadRequest, ModelNotFound, shorten
from clew.serve.prometheus import ServeMetrics
from clew.serve.prompt import PromptLimits, build_prompt
from clew.serve.protocol import ChatCompletionRequest, model_card
from clew.serve.scheduler import GenerationRequest, Scheduler

log = logging.getLogger(__name__)

MODEL_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
MAX_STOP_STRINGS = 4
# After --shutdown-timeout: seconds for the 503s of the requests stopped then to be written,
# and after that for the process to exit before it is ended (``run_server``).
ANSWER_GRACE_S = 3.0
EXIT_GRACE_S = 8.0


@dataclass(frozen=True)
class ServeSettings:
    """What ``clew serve`` serves and the limits it holds requests to."""

    model_id: str
    adapters: str | None = None  # prefix: a local directory or s3://bucket/prefix
    max_adapters: int = 4
    api_key: str | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    default_max_tokens: int = 1024
    max_n: int = 16
    max_batch_rows: int = 64
    max_queue: int = 1024
    max_request_bytes: int = 64 << 20
    limits: PromptLimits = field(default_factory=PromptLimits)
    encode_threads: int = 2
    tokens_per_step: int = 1
    adapter_check_s: float = 2.0  # how often a request re-reads its adapter's file stamps
    shutdown_timeout: float = 60.0  # seconds in-flight requests may take after SIGTERM

    def __post_init__(self) -> None:
        if not MODEL_ID_RE.fullmatch(self.model_id):
            raise ClewError(
                f"--model-id {self.model_id!r} is not accepted: letters, digits, '.', '_', '-' "
                "and '/', starting with a letter or digit (':' separates adapters)"
            )


class Server:
    """One base model, its adapters and the scheduler that runs them."""

    def __init__(
        self, model: Any, processor: Any, engine: InferenceEngine, settings: ServeSettings
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = ServeMetrics()
        self.store = AdapterStore(settings.adapters, check_ttl_s=settings.adapter_check_s)
        self.served: set[str] = set()  # adapters loaded at least once: their metric labels
        self.adapters = LoadedAdapters(
            engine,
            self.store,
            settings.max_adapters,
            on_load=self._loaded,
            on_evict=self._evicted,
        )
        self.scheduler = Scheduler(
            engine,
            self.adapters,
            self.metrics,
            max_batch_rows=settings.max_batch_rows,
            max_queue=settings.max_queue,
            tokens_per_step=settings.tokens_per_step,
        )
        text = getattr(model.config, "text_config", model.config)
        self.max_model_len = settings.max_model_len or int(text.max_position_embeddings)
        self.created = int(time.time())
        self.started = False
        self.draining = False
        local = threading.local()

        def own_chat() -> None:
            local.chat = ChatFormat(copy.deepcopy(processor))

        self._local = local
        self._encoder = ThreadPoolExecutor(
            settings.encode_threads, thread_name_prefix="clew-encode", initializer=own_chat
        )

    @classmethod
    def open(
        cls,
        model_dir: str,
        settings: ServeSettings,
        *,
        device: str = "auto",
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        max_cache_mb: int = 4096,
    ) -> Server:
        from clew.inference.runtime import open_policy

        policy = open_policy(
            model_dir,
            device=device,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_cache_mb=max_cache_mb,
        )
        return cls(policy.model, policy.processor, policy.engine, settings)

    def start(self) -> None:
        if not self.started:
            self.scheduler.start()
            self.started = True
            self.announce()

    def announce(self) -> None:
        """Log what is served and the limits; warn when anyone may use it."""
        s, lim = self.settings, self.settings.limits
        if not s.api_key:
            log.warning(
                "no API key is set: anyone who can reach this server may use its models and "
                "the playground (set --api-key or $CLEW_SERVE_API_KEY)"
            )
        log.info(
            "serving %s with adapters %s; limits: max_model_len=%d default_max_tokens=%d "
            "max_n=%d max_batch_size=%d max_queue=%d max_adapters=%d max_images=%d "
            "max_image_bytes=%d max_image_pixels=%d max_request_bytes=%d "
            "remote_images=%s shutdown_timeout=%gs",
            s.model_id,
            f"under {s.adapters} as {s.model_id}:NAME" if s.adapters else "off (no --adapters)",
            self.max_model_len,
            s.default_max_tokens,
            s.max_n,
            s.max_batch_rows,
            s.max_queue,
            s.max_adapters,
            lim.max_images,
            lim.max_image_bytes,
            lim.max_image_pixels,
            s.max_request_bytes,
            "allowed" if lim.allow_remote_images else "refused",
            s.shutdown_timeout,
        )

    def begin_shutdown(self, timeout: float | None = None) -> None:
        """Stop taking requests; those in flight may run ``timeout`` seconds more (default:
        the settings' ``shutdown_timeout``), then they are answered with a 503."""
        timeout = self.settings.shutdown_timeout if timeout is None else timeout
        self.draining = True
        self.scheduler.drain(time.monotonic() + timeout)

    def close(self, timeout: float = 2.0) -> None:
        """End what still runs (a 503 each) and stop, waiting for the scheduler's thread up
        to ``timeout`` seconds: a step that never returns cannot hold the process."""
        self.draining = True
        self.scheduler.close(timeout)
        self._encoder.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    # -- names ----------------------------------------------------------------------
    async def resolve(self, model: str) -> str | None:
        """None for the base, the adapter's name for ``ID:NAME``; 404 for anything else."""
        base = self.settings.model_id
        if model == base:
            return None
        if model.startswith(base + ":"):
            return check_name(model[len(base) + 1 :])
        raise await asyncio.to_thread(self.not_found, model)

    def model_ids(self) -> list[str]:
        """The base and every adapter that can be loaded (``AdapterStore.loadable``)."""
        base = self.settings.model_id
        return [base, *(f"{base}:{n}" for n in self.store.loadable())]

    def label(self, adapter: str | None) -> str:
        """The metrics' ``model`` label of a request for ``adapter`` (module docstring)."""
        if adapter is None:
            return "base"
        return adapter if adapter in self.served else "unknown"

    def model_cards(self) -> list[dict[str, Any]]:
        base = self.settings.model_id
        cards = [model_card(base, self.created)]
        return cards + [model_card(m, self.created, base) for m in self.model_ids()[1:]]

    def not_found(self, model: str) -> ModelNotFound:
        ids = self.model_ids()
        listed = ", ".join(ids[:50]) + (f" (and {len(ids) - 50} more)" if len(ids) > 50 else "")
        return ModelNotFound(
            f"the model {shorten(model)} does not exist; this server serves: {listed} "
            "(GET /v1/models)",
            param="model",
        )

    # -- requests -------------------------------------------------------------------
    async def prepare(
        self, body: ChatCompletionRequest, adapter: str | None, request_id: str = ""
    ) -> GenerationRequest:
        """The engine's view of ``body``; ``ServeError`` for anything it cannot serve. An
        adapter not loaded, or whose files changed since it was, is fetched first."""
        s = self.settings
        unsupported = body.unsupported()
        if unsupported:
            raise BadRequest(f"{unsupported} is not supported by this server", param=unsupported)
        n = body.n or 1
        if n > s.max_n:
            raise BadRequest(f"n={n} is over this server's limit of {s.max_n}", param="n")
        stop = body.stop_strings()
        if len(stop) > MAX_STOP_STRINGS or any(not x for x in stop):
            raise BadRequest(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
        if adapter is not None:
            try:
                stamp = await asyncio.to_thread(self.store.check, adapter)
                if self.adapters.stamp(adapter) != stamp:
                    await asyncio.wrap_future(self.store.prepare(adapter))
            except ModelNotFound:
                raise await asyncio.to_thread(self.not_found, body.model) from None
            except AdapterUnavailable:
                self.metrics.adapter_load_failures.inc()
                raise
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(self._encoder, self._encode, body)
        prompt_tokens = len(prompt.token_ids)
        room = self.max_model_len - prompt_tokens
        asked = body.max_completion_tokens or body.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise BadRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"messages take {prompt_tokens} and the completion asks for "
                f"{asked if asked is not None else 'at least 1'}; shorten the messages or "
                "lower max_tokens",
                param="messages",
                code="context_length_exceeded",
            )
        return GenerationRequest(
            adapter=adapter,
            prompt=prompt,
            max_tokens=asked if asked is not None else min(s.default_max_tokens, room),
            n=n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=stop,
            seed=body.seed,
            allowed_tokens=tuple(body.allowed_tokens or ()),
            request_id=request_id,
        )

    def _encode(self, body: ChatCompletionRequest):
        chat: ChatFormat = self._local.chat
        if body.allowed_tokens is not None and not body.allowed_tokens:
            raise BadRequest("allowed_tokens must name at least one token", param="allowed_tokens")
        for text in body.allowed_tokens or ():
            if len(chat.encode_text(text)) != 1:
                raise BadRequest(
                    f"allowed_tokens: {text!r} is not one token of this model's vocabulary",
                    param="allowed_tokens",
                )
        return build_prompt(
            body.messages,
            chat,
            self.settings.limits,
            continue_final=bool(body.continue_final_message),
        )

    # -- metrics hooks (scheduler thread) ---------------------------------------------
    def _loaded(self, name: str, seconds: float) -> None:
        self.served.add(name)
        self.metrics.adapter_loads.labels(name).inc()
        self.metrics.adapter_load_seconds.observe(seconds)
        self.metrics.adapters_loaded.set(len(self.adapters.names()))

    def _evicted(self, name: str) -> None:
        self.metrics.adapter_evictions.labels(name).inc()
        self.metrics.adapters_loaded.set(len(self.adapters.names()))


def run_server(
    server: Server,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; then take no new request, let those in flight run up to
    ``shutdown_timeout`` seconds (default: the settings'), answer the ones still running
    with a 503 and stop.

    uvicorn waits ``ANSWER_GRACE_S`` longer for those answers to be written, and a timer
    ends the process ``EXIT_GRACE_S`` after the timeout whatever still runs (a step that
    never returns, a stuck fetch), so the process is gone within the timeout and a few
    seconds, always."""
    import uvicorn

    from clew.serve.app import create_app

    if shutdown_timeout is None:
        shutdown_timeout = server.settings.shutdown_timeout

    class _Draining(uvicorn.Server):
        stopping = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.stopping:
                self.stopping = True
                log.info(
                    "stopping: no new requests; those in flight have %gs to finish",
                    shutdown_timeout,
                )
                server.begin_shutdown(shutdown_timeout)
                _exit_after(shutdown_timeout + EXIT_GRACE_S)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        create_app(server),
        host=host,
        port=port,
        timeout_graceful_shutdown=shutdown_timeout + ANSWER_GRACE_S,
        log_level="info",
        log_config=_log_config(),
    )
    _Draining(config).run()


def _exit_after(seconds: float) -> None:
    """End the process in ``seconds`` unless it has exited by then."""

    def end() -> None:
        log.error("still running %.0fs after the signal to stop: exiting now", seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()


def _log_config() -> dict[str, Any]:
    """uvicorn's logging, with clew's own loggers (``clew.*``) written the same way."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["clew"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config
