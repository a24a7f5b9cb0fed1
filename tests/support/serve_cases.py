"""Shared pieces of the ``clew serve`` tests: a tiny base, adapters, a server on loopback."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from PIL import Image

IMAGE_SIZE = 56
MODEL_ID = "visgym-tiny"


def make_base() -> Path:
    """The tiny base the serve tests share (``support.tiny``: read only)."""
    from support.tiny import tiny_policy

    return tiny_policy(image_size=IMAGE_SIZE)


def make_adapter(base: Path, out: Path, *, rank: int, seed: int) -> Path:
    """A LoRA adapter of ``base`` at ``out`` (the caller's to change), exported as clew's
    worker group exports one (peft's files plus the processor), its B factors random so that
    it changes the base's replies. Built once per process for the same arguments
    (``support.tiny.cached_path``), then copied."""
    from support.tiny import cached_path

    args = {"base": str(base), "rank": rank, "seed": seed}
    built = cached_path(
        "adapter", args, lambda path: _build_adapter(base, path, rank, seed), f"r{rank}-s{seed}"
    )
    shutil.copytree(built, out)
    return out


def _build_adapter(base: Path, out: Path, rank: int, seed: int) -> None:
    from clew.models import load_policy
    from clew.train.lora import apply_lora

    model, processor = load_policy(base)
    torch.manual_seed(seed)  # peft draws the A factors from the global generator
    peft_model = apply_lora(model, rank=rank, alpha=2 * rank)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    peft_model.save_pretrained(out)
    processor.save_pretrained(out)


def make_prefix(base: Path, root: Path) -> Path:
    """alpha and gamma as PREFIX/NAME, beta as PREFIX/NAME/policy (a run's export layout)."""
    prefix = root / "adapters"
    make_adapter(base, prefix / "alpha", rank=4, seed=1)
    make_adapter(base, prefix / "beta" / "policy", rank=8, seed=2)
    make_adapter(base, prefix / "gamma", rank=2, seed=3)
    return prefix


def add_corrupt(prefix: Path) -> None:
    """``broken``: a config but weights that are not safetensors."""
    shutil.copytree(prefix / "alpha", prefix / "broken")
    (prefix / "broken" / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 64)


def png_url(size: int = IMAGE_SIZE, color: tuple[int, int, int] = (20, 180, 40)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(text: str = "Which way to the goal?", url: str | None = None) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": url or png_url()}}]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


@contextlib.contextmanager
def serving(server: Any) -> Iterator[str]:
    """``server`` (a ``clew.serve.server.Server``) on a free loopback port; yields its URL."""
    import uvicorn

    from clew.serve.app import create_app

    config = uvicorn.Config(
        create_app(server), host="127.0.0.1", port=0, log_level="warning", lifespan="on"
    )
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(30)


def open_server(base: Path, **settings: Any) -> Any:
    from clew.serve.server import Server, ServeSettings

    settings.setdefault("model_id", MODEL_ID)
    return Server.open(str(base), ServeSettings(**settings), device="cpu")


def client(url: str, api_key: str = "unused") -> Any:
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


@contextlib.contextmanager
def prompts(server: Any) -> Iterator[list[Any]]:
    """The prompt (a ``clew.models.chat.Chunk``) of every request the server hands its
    scheduler within the block."""
    seen: list[Any] = []
    submit = server.scheduler.submit

    def recording(request, loop):
        seen.append(request.prompt)
        return submit(request, loop)

    server.scheduler.submit = recording
    try:
        yield seen
    finally:
        del server.scheduler.submit


def served_prompt(server: Any, url: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    """The prompt ``server`` (served at ``url``) encodes ``messages`` to, as a ``Chunk``."""
    with prompts(server) as seen:
        r = client(url).chat.completions.create(
            model=MODEL_ID, messages=messages, max_tokens=1, temperature=0, **kw
        )
    assert len(seen) == 1 and r.usage.prompt_tokens == len(seen[0].token_ids)
    return seen[0]


def post(url: str, body: bytes | dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """POST raw bytes (or JSON) and return (status, parsed JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
