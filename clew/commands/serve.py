"""``clew serve``: the OpenAI-compatible server (``clew.serve``)."""

from __future__ import annotations

import argparse
import os

from clew.agent.flags import API_KEY_ENV, positive_int
from clew.commands.registry import Handler, command


@command(
    "serve",
    "serve a policy and its LoRA adapters over an OpenAI-compatible API "
    "(/v1/chat/completions, /v1/models)",
)
def _serve(p: argparse.ArgumentParser) -> Handler:
    p.epilog = (
        "Models: ID is the base, ID:NAME the adapter in PREFIX/NAME (or PREFIX/NAME/policy). "
        f"The API key may also come from ${API_KEY_ENV} (a flag's value shows in the process "
        "list). Health: GET /health, /ready; metrics: GET /metrics; a page that plays envs "
        "with the served models: GET /playground. docs/serving.md lists the limits and what "
        "each refusal means."
    )
    p.add_argument("--model", required=True, help="base policy directory")
    p.add_argument(
        "--model-id", required=True, help="the name clients ask for, e.g. visgym-qwen3vl"
    )
    p.add_argument(
        "--adapters",
        metavar="PREFIX",
        help="folder or s3://bucket/prefix with one sub-folder per PEFT adapter",
    )
    p.add_argument(
        "--max-adapters", type=positive_int, default=4, help="adapters held at once (LRU)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (or ${API_KEY_ENV})")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU), float32, bfloat16")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the GPU the process may use; the KV cache gets what weights leave",
    )
    p.add_argument("--max-cache-mb", type=positive_int, default=4096, help="KV cache on a CPU")
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        help="prompt plus completion tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=1024,
        help="completion tokens when a request sets no max_tokens",
    )
    p.add_argument("--max-batch-size", type=positive_int, default=64, help="sequences at once")
    p.add_argument(
        "--tokens-per-step",
        type=positive_int,
        default=1,
        help="tokens each batch samples between scheduling rounds (1: stream token by token)",
    )
    p.add_argument("--max-n", type=positive_int, default=16, help="largest n a request may ask")
    p.add_argument(
        "--max-queue",
        type=positive_int,
        default=1024,
        help="requests that may wait for room; more are refused with a 503 (overloaded)",
    )
    p.add_argument("--max-images", type=positive_int, default=8, help="images per request")
    p.add_argument(
        "--max-image-bytes", type=positive_int, default=8 << 20, help="encoded size of one image"
    )
    p.add_argument(
        "--max-image-pixels", type=positive_int, default=16 << 20, help="pixels of one image"
    )
    p.add_argument(
        "--max-request-bytes", type=positive_int, default=64 << 20, help="request body size"
    )
    p.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="fetch http(s) image URLs (the server then fetches any URL a client names)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="after SIGTERM/SIGINT: seconds the requests in flight may take to finish; those "
        "still running then get a 503 (shutting_down), and the process exits a few seconds "
        "later whatever still runs",
    )

    def run(args: argparse.Namespace) -> int:
        from clew.serve.prompt import PromptLimits
        from clew.serve.server import Server, ServeSettings, run_server

        settings = ServeSettings(
            model_id=args.model_id,
            adapters=args.adapters,
            max_adapters=args.max_adapters,
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            max_model_len=args.max_model_len,
            default_max_tokens=args.default_max_tokens,
            max_n=args.max_n,
            max_queue=args.max_queue,
            max_batch_rows=args.max_batch_size,
            tokens_per_step=args.tokens_per_step,
            max_request_bytes=args.max_request_bytes,
            shutdown_timeout=args.shutdown_timeout,
            limits=PromptLimits(
                max_images=args.max_images,
                max_image_bytes=args.max_image_bytes,
                max_image_pixels=args.max_image_pixels,
                allow_remote_images=args.allow_remote_images,
            ),
        )
        server = Server.open(
            args.model,
            settings,
            device=args.device,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_cache_mb=args.max_cache_mb,
        )
        run_server(server, args.host, args.port)
        return 0

    return run


def _seconds(text: str) -> float:
    """A number of seconds >= 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value
