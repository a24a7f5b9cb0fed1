"""`clew serve` under load: many concurrent openai clients against the same requests one at a time.

Builds a base policy from ``--preset`` and two random LoRA adapters (ranks ``--rank`` and
``--rank-b``, as clew exports them), starts ``clew serve`` on them in a child process on
loopback, and drives it with the official ``openai`` client. Every request is one image (a
distinct random ``--image-size`` PNG as a data URL) and a question, for the base or one of
the two adapters in turn, greedy, at most ``--max-tokens`` tokens. Two passes over the same
requests, after a warm-up that loads both adapters:

* ``sequential``: one client, one request at a time (the first ``--baseline-requests``);
* ``concurrent``: ``--clients`` clients at once (asyncio, one request each at a time), ``--requests``
  in all.

Printed per pass: requests/s, completion tokens/s, p50 and p99 latency (send to last byte),
errors (any exception or non-2xx), then the concurrent pass's throughput over the sequential
one's and its p99 over its p50.

    python benchmarks/serve.py --preset tiny --clients 16 --requests 48 --baseline-requests 12
    python benchmarks/serve.py --preset qwen3vl-8b --device cuda --clients 64 --requests 512
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

MODEL_ID = "bench"


@dataclass
class Outcome:
    seconds: float
    tokens: int
    error: str | None = None


def build(preset: str, root: Path, device: str, rank: int, rank_b: int) -> tuple[Path, Path]:
    """The base policy and a prefix holding adapters ``a`` and ``b``."""
    from clew.envs.base import text_corpus
    from clew.models import build_model, load_policy
    from clew.train.lora import apply_lora

    build_model(
        preset,
        root / "base",
        corpus=text_corpus(),
        device=device if device.startswith("cuda") else None,
        overwrite=True,
    )
    base = root / "base"
    for name, r, seed in (("a", rank, 1), ("b", rank_b, 2)):
        model, processor = load_policy(base)
        torch.manual_seed(seed)  # peft draws the A factors from the global generator
        peft_model = apply_lora(model, rank=r, alpha=2 * r)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_B" in pname:  # nonzero B: the adapter changes the replies
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        peft_model.save_pretrained(root / "adapters" / name)
        processor.save_pretrained(root / "adapters" / name)
        del model, peft_model
    return base, root / "adapters"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(base: Path, adapters: Path, port: int, args: argparse.Namespace):
    command = [
        sys.executable,
        "-m",
        "clew",
        "serve",
        "--model",
        str(base),
        "--model-id",
        MODEL_ID,
        "--adapters",
        str(adapters),
        "--max-adapters",
        "2",
        "--port",
        str(port),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-batch-size",
        str(args.max_batch_size),
        "--tokens-per-step",
        str(args.tokens_per_step),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"clew serve exited:\n{proc.stderr.read().decode()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("clew serve did not become ready in 600 s")


def requests_for(count: int, image_size: int, seed: int) -> list[dict]:
    """``count`` chat requests, each its own image, for the base, a and b in turn."""
    rng = np.random.default_rng(seed)
    models = [MODEL_ID, f"{MODEL_ID}:a", f"{MODEL_ID}:b"]
    out = []
    for i in range(count):
        pixels = rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        content = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Which way to the goal? Answer with one move."},
        ]
        out.append({"model": models[i % 3], "messages": [{"role": "user", "content": content}]})
    return out


async def one(client, request: dict, max_tokens: int) -> Outcome:
    t0 = time.perf_counter()
    try:
        reply = await client.chat.completions.create(
            **request, max_tokens=max_tokens, temperature=0
        )
    except Exception as exc:  # counted, not raised: the run reports its errors
        return Outcome(time.perf_counter() - t0, 0, f"{type(exc).__name__}: {exc}"[:200])
    return Outcome(time.perf_counter() - t0, reply.usage.completion_tokens)


async def drive(url: str, requests: list[dict], clients: int, max_tokens: int):
    """Send ``requests`` from ``clients`` concurrent clients; (outcomes, wall seconds)."""
    import openai

    queue: asyncio.Queue[dict] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    outcomes: list[Outcome] = []

    async def worker() -> None:
        async with openai.AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key="unused",
            max_retries=0,
            timeout=600,
        ) as client:
            while not queue.empty():
                outcomes.append(await one(client, queue.get_nowait(), max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return outcomes, time.perf_counter() - t0


def summary(name: str, clients: int, outcomes: list[Outcome], wall: float) -> dict:
    ok = [o for o in outcomes if o.error is None]
    latencies = sorted(o.seconds for o in ok) or [float("nan")]
    p50 = statistics.median(latencies)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    row = {
        "name": name,
        "clients": clients,
        "requests": len(outcomes),
        "req_s": len(ok) / wall,
        "tok_s": sum(o.tokens for o in ok) / wall,
        "p50": p50,
        "p99": p99,
        "errors": len(outcomes) - len(ok),
    }
    print(
        f"{name:<11} {clients:>7} {row['requests']:>8} {row['req_s']:>8.2f} {row['tok_s']:>9.1f} "
        f"{p50 * 1e3:>9.0f} {p99 * 1e3:>9.0f} {row['errors']:>6}"
    )
    for error in sorted({o.error for o in outcomes if o.error})[:3]:
        print(f"  error: {error}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients")
    p.add_argument("--requests", type=int, default=256, help="requests of the concurrent pass")
    p.add_argument(
        "--baseline-requests",
        type=int,
        default=None,
        help="requests of the one-at-a-time pass, the first of the same list (default: all)",
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--image-size", type=int, default=112, help="pixels a side of each image")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rank-b", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # the build only; the server picks its own threads
    with tempfile.TemporaryDirectory(prefix="clew-serve-bench") as tmp:
        base, adapters = build(args.preset, Path(tmp), args.device, args.rank, args.rank_b)
        port = free_port()
        server = start_server(base, adapters, port, args)
        url = f"http://127.0.0.1:{port}"
        try:
            requests = requests_for(args.requests, args.image_size, args.seed)
            baseline = requests[: args.baseline_requests or len(requests)]
            warm = requests_for(3, args.image_size, args.seed + 1)  # base, a, b: loads both
            asyncio.run(drive(url, warm, 1, args.max_tokens))
            print(
                f"clew serve: {args.preset} on {args.device}, adapters a (rank {args.rank}) and "
                f"b (rank {args.rank_b}), {args.image_size}px images, max_tokens "
                f"{args.max_tokens}, greedy, base/a/b in turn"
            )
            print(
                f"{'pass':<11} {'clients':>7} {'requests':>8} {'req/s':>8} {'tok/s':>9} "
                f"{'p50 ms':>9} {'p99 ms':>9} {'errors':>6}"
            )
            seq = summary("sequential", 1, *asyncio.run(drive(url, baseline, 1, args.max_tokens)))
            con = summary(
                "concurrent",
                args.clients,
                *asyncio.run(drive(url, requests, args.clients, args.max_tokens)),
            )
            print(
                f"concurrent over sequential: {con['req_s'] / seq['req_s']:.1f}x requests/s; "
                f"concurrent p99/p50 {con['p99'] / con['p50']:.2f}"
            )
        finally:
            server.terminate()
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    main()
