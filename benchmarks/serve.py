"""`clew serve` under steady load: many concurrent openai clients against one client at a time.

Builds a base policy from ``--preset`` and two random LoRA adapters (ranks ``--rank`` and
``--rank-b``, as clew exports them), starts ``clew serve`` on them in a child process on
loopback, and drives it with the official ``openai`` client. Every request is one image (a
distinct random ``--image-size`` PNG as a data URL, ``--requests`` of them, cycled) and a
question, for the base or one of the two adapters in turn, greedy, at most ``--max-tokens``
tokens (several, comma-separated, are taken in turn: replies of mixed lengths, where a short
request should not wait for long ones). After a warm-up request per model (which loads both adapters), two passes:

* ``sequential``: one client, one request at a time;
* ``concurrent``: ``--clients`` clients at once.

Each pass is a closed loop: every client sends its next request as soon as its last one
returns, so the server holds ``clients`` requests at all times. Steady load is measured
after the loop has run ``--warmup`` seconds (the first requests all arrive at once: a burst
of prefills no steady server sees) for ``--duration`` seconds: throughput
counts the requests completed inside that window, latency (send to last byte) those sent
inside it, which the clients wait for before they stop. Errors (any exception or non-2xx)
count over the whole pass. The openai clients are made before the loop starts (each one
reads the system's CA certificates, about 20 ms of CPU).

Printed per pass: the requests completed in the window, requests/s, completion tokens/s, p50
and p99 latency and errors (and the p50 per max_tokens when there are several), then the
concurrent pass's throughput over the sequential one's and its p99 over its p50.

The server's torch pool gets ``--server-threads`` threads (OMP_NUM_THREADS; on the CPU 1
by default): on a small machine the load generator needs the other cores, and a pool spread
over cores that the clients keep busy spins against them (each decode step took four times
as long with 2 threads on 2 cores, 2026-12-05). Both passes run against the same server.

    python benchmarks/serve.py --preset tiny --clients 64
    python benchmarks/serve.py --preset qwen3vl-8b --device cuda --clients 64 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
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
    max_tokens: int
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
    if args.server_threads:
        env["OMP_NUM_THREADS"] = str(args.server_threads)
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


def requests_for(count: int, image_size: int, lengths: tuple[int, ...], seed: int) -> list[dict]:
    """``count`` chat requests, each its own image, for the base, a and b in turn, and for
    each of them every max_tokens of ``lengths`` in turn."""
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
        out.append(
            {
                "model": models[i % 3],
                "messages": [{"role": "user", "content": content}],
                "max_tokens": lengths[i // 3 % len(lengths)],
            }
        )
    return out


async def one(client, request: dict) -> Outcome:
    t0 = time.perf_counter()
    try:
        reply = await client.chat.completions.create(**request, temperature=0)
    except Exception as exc:  # counted, not raised: the run reports its errors
        error = f"{type(exc).__name__}: {exc}"[:200]
        return Outcome(time.perf_counter() - t0, 0, request["max_tokens"], error)
    return Outcome(time.perf_counter() - t0, reply.usage.completion_tokens, request["max_tokens"])


@dataclass
class Pass:
    """One closed-loop pass: what its measured window saw."""

    clients: int
    sent_inside: list[Outcome]  # the requests sent inside the window
    completed: int  # requests that completed inside the window without an error
    tokens: int  # their completion tokens
    errors: int  # over the whole pass, warm-up included
    seconds: float  # the window


async def drive(url: str, requests: list[dict], clients: int, args: argparse.Namespace) -> Pass:
    """``clients`` clients in a closed loop over ``requests`` (cycled) for ``--warmup`` and
    then ``--duration`` seconds, the measured window."""
    import openai

    pool = [
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        for _ in range(clients)
    ]
    counter = itertools.count()
    start = time.perf_counter()
    opens, closes = start + args.warmup, start + args.warmup + args.duration
    timed: list[tuple[float, Outcome]] = []  # (sent at, outcome)

    async def loop(client) -> None:
        while (sent := time.perf_counter()) < closes:
            request = requests[next(counter) % len(requests)]
            timed.append((sent, await one(client, request)))

    try:
        await asyncio.gather(*(loop(c) for c in pool))
    finally:
        for c in pool:
            await c.close()
    done = [o for sent, o in timed if o.error is None and opens <= sent + o.seconds <= closes]
    return Pass(
        clients=clients,
        sent_inside=[o for sent, o in timed if sent >= opens],
        completed=len(done),
        tokens=sum(o.tokens for o in done),
        errors=sum(o.error is not None for _, o in timed),
        seconds=args.duration,
    )


async def warm_up(url: str, requests: list[dict]) -> None:
    """One request each, in turn: the adapters load and the server's first forwards run."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        for request in requests:
            outcome = await one(c, request)
            if outcome.error:
                raise SystemExit(f"the warm-up request failed: {outcome.error}")


def summary(name: str, run: Pass) -> dict:
    ok = [o for o in run.sent_inside if o.error is None]
    latencies = sorted(o.seconds for o in ok) or [float("nan")]
    p50 = statistics.median(latencies)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    row = {
        "name": name,
        "clients": run.clients,
        "requests": run.completed,
        "req_s": run.completed / run.seconds,
        "tok_s": run.tokens / run.seconds,
        "p50": p50,
        "p99": p99,
        "errors": run.errors,
    }
    print(
        f"{name:<11} {run.clients:>7} {row['requests']:>8} {row['req_s']:>8.2f} "
        f"{row['tok_s']:>9.1f} {p50 * 1e3:>9.0f} {p99 * 1e3:>9.0f} {row['errors']:>6}"
    )
    lengths = sorted({o.max_tokens for o in ok})
    if len(lengths) > 1:
        by_length = ", ".join(
            f"{n}: {statistics.median(o.seconds for o in ok if o.max_tokens == n) * 1e3:.0f}"
            for n in lengths
        )
        print(f"  p50 ms by max_tokens: {by_length}")
    for error in sorted({o.error for o in run.sent_inside if o.error})[:3]:
        print(f"  error: {error}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients")
    p.add_argument("--requests", type=int, default=256, help="distinct requests, cycled")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of each pass not measured")
    p.add_argument("--duration", type=float, default=15.0, help="seconds measured per pass")
    p.add_argument(
        "--max-tokens",
        default="16",
        help="max_tokens of the requests; several (comma-separated) are taken in turn",
    )
    p.add_argument("--image-size", type=int, default=112, help="pixels a side of each image")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rank-b", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument(
        "--server-threads",
        type=int,
        default=None,
        help="the server's torch threads (OMP_NUM_THREADS; default 1 on the CPU, else unset)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.server_threads is None and args.device == "cpu":
        args.server_threads = 1
    if args.device == "cpu":
        torch.set_num_threads(1)  # the build only; the server has its own
    with tempfile.TemporaryDirectory(prefix="clew-serve-bench") as tmp:
        base, adapters = build(args.preset, Path(tmp), args.device, args.rank, args.rank_b)
        port = free_port()
        server = start_server(base, adapters, port, args)
        url = f"http://127.0.0.1:{port}"
        try:
            lengths = tuple(int(n) for n in args.max_tokens.split(","))
            requests = requests_for(args.requests, args.image_size, lengths, args.seed)
            asyncio.run(warm_up(url, requests_for(3, args.image_size, (4,), args.seed + 1)))
            print(
                f"clew serve: {args.preset} on {args.device} ({args.server_threads or 'default'} "
                f"torch threads), adapters a (rank {args.rank}) and b (rank {args.rank_b}), "
                f"{args.image_size}px images, max_tokens {args.max_tokens}, greedy, base/a/b in "
                f"turn; closed loops, {args.warmup:g} s warm-up, {args.duration:g} s measured"
            )
            print(
                f"{'pass':<11} {'clients':>7} {'requests':>8} {'req/s':>8} {'tok/s':>9} "
                f"{'p50 ms':>9} {'p99 ms':>9} {'errors':>6}"
            )
            seq = summary("sequential", asyncio.run(drive(url, requests, 1, args)))
            con = summary("concurrent", asyncio.run(drive(url, requests, args.clients, args)))
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
