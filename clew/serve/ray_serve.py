"""``clew.serve:build_app``: the ``clew serve`` server as a Ray Serve application.

One deployment, ``ClewServer``. Each replica opens the base policy and its engine once and
serves ``create_app(server)``, the same FastAPI app ``clew serve`` runs under uvicorn, behind
Ray Serve's HTTP proxy: the same routes, errors, streaming, API key, health and metrics.
Ray Serve builds the app inside the replica (``__serve_build_asgi_app__``), because the app
wraps a live ``Server`` that cannot be pickled, and runs its lifespan there, so the
scheduler starts with the replica and finishes its requests when the replica stops.

A Serve config (a KubeRay RayService's ``serveConfigV2``) names the builder and its args::

    applications:
      - name: clew
        import_path: clew.serve:build_app
        route_prefix: /
        args: {model: /shared/models/base, model_id: visgym-qwen3vl, adapters: /shared/adapters}
        deployments:
          - name: ClewServer
            autoscaling_config: {min_replicas: 1, max_replicas: 6, target_ongoing_requests: 32}
            ray_actor_options: {num_cpus: 4, num_gpus: 1}

Replicas, autoscaling and each replica's resources are Serve's own deployment options and
come from that ``deployments`` entry; the defaults here are one replica on one CPU. ``args``
are ``BuildArgs``: the flags of ``clew serve`` spelled with underscores, unknown keys
refused. The API key is never an arg, since anyone who may read the RayService reads its
config: each replica reads it from the environment variable ``api_key_env`` names (on
Kubernetes, set from a Secret), and with ``require_api_key`` a replica without it fails to
start rather than serve without a key.

Why ``max_ongoing_requests`` is raised from Serve's default of 5: the engine batches the
requests a replica holds, so a replica limited to 5 at a time would never batch more than 5.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError
from ray import serve
from ray.serve import Application

from clew.agent.flags import API_KEY_ENV
from clew.errors import ConfigError
from clew.serve.server import Server, ServeSettings

DEPLOYMENT = "ClewServer"
# Enough requests per replica to fill the scheduler's default batch (64 rows) with more
# waiting, so a batch can refill between decode steps.
MAX_ONGOING_REQUESTS = 128


class BuildArgs(BaseModel):
    """The Serve config's ``args`` for ``build_app``: ``clew serve``'s flags. A limit left
    unset (None) keeps ``clew serve``'s default."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field(min_length=1, description="base policy directory")
    model_id: str = Field(min_length=1, description="the name clients ask for")
    adapters: str | None = Field(None, description="folder or s3:// prefix of PEFT adapters")
    max_adapters: PositiveInt | None = None
    api_key_env: str = Field(API_KEY_ENV, min_length=1, description="variable holding the key")
    require_api_key: bool = False
    device: str = "auto"
    dtype: str = "auto"
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_cache_mb: PositiveInt = 4096
    max_model_len: PositiveInt | None = None
    default_max_tokens: PositiveInt | None = None
    max_batch_size: PositiveInt | None = None
    tokens_per_step: PositiveInt | None = None
    max_n: PositiveInt | None = None
    max_queue: PositiveInt | None = None
    max_images: PositiveInt | None = None
    max_image_bytes: PositiveInt | None = None
    max_image_pixels: PositiveInt | None = None
    max_request_bytes: PositiveInt | None = None
    allow_remote_images: bool = False

    def settings(self, environ: Mapping[str, str] = os.environ) -> ServeSettings:
        """The server's settings, the API key read from ``environ``."""
        from clew.serve.prompt import PromptLimits

        key = environ.get(self.api_key_env) or None
        if key is None and self.require_api_key:
            raise ConfigError(
                f"require_api_key is set but ${self.api_key_env} is empty or unset in the "
                "replica's environment: set it (on Kubernetes, from a Secret) or drop "
                "require_api_key"
            )
        limits = {
            name: getattr(self, name)
            for name in ("max_images", "max_image_bytes", "max_image_pixels")
            if getattr(self, name) is not None
        }
        renamed = {"max_batch_size": "max_batch_rows"}
        optional = (
            "max_adapters",
            "max_model_len",
            "default_max_tokens",
            "max_batch_size",
            "tokens_per_step",
            "max_n",
            "max_queue",
            "max_request_bytes",
        )
        given = {
            renamed.get(name, name): getattr(self, name)
            for name in optional
            if getattr(self, name) is not None
        }
        return ServeSettings(
            model_id=self.model_id,
            adapters=self.adapters,
            api_key=key,
            limits=PromptLimits(allow_remote_images=self.allow_remote_images, **limits),
            **given,
        )

    def open(self) -> Server:
        return Server.open(
            self.model,
            self.settings(),
            device=self.device,
            dtype=self.dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_cache_mb=self.max_cache_mb,
        )


def parse_args(args: dict[str, Any] | BuildArgs) -> BuildArgs:
    """``args`` as ``BuildArgs``; a ``ConfigError`` naming each wrong key and the accepted ones."""
    if isinstance(args, BuildArgs):
        return args
    try:
        return BuildArgs.model_validate(args)
    except ValidationError as err:
        lines = [
            f"{'.'.join(str(x) for x in e['loc']) or 'args'}: {e['msg']}" for e in err.errors()
        ]
        accepted = ", ".join(BuildArgs.model_fields)
        raise ConfigError(
            f"clew.serve:build_app args: {'; '.join(lines)} (accepted: {accepted})"
        ) from None


@serve.deployment(
    name=DEPLOYMENT,
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    graceful_shutdown_timeout_s=60,  # as `clew serve --shutdown-timeout`
    ray_actor_options={"num_cpus": 1},
)
@serve.ingress()
class ClewServer:
    """A replica: one ``Server`` (base policy, engine, adapters) behind the HTTP app."""

    def __init__(self, args: BuildArgs) -> None:
        self.server = args.open()

    def __serve_build_asgi_app__(self) -> FastAPI:
        from clew.serve.app import create_app

        return create_app(self.server)

    def check_health(self) -> None:
        """Serve restarts a replica whose scheduler thread died."""
        if self.server.started and not self.server.scheduler.alive:
            raise RuntimeError("the scheduler thread of this replica is not running")


def build_app(args: dict[str, Any]) -> Application:
    """The Ray Serve application for ``args`` (``BuildArgs``); the model opens in each replica."""
    return ClewServer.bind(parse_args(args))
