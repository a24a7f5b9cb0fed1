"""`clew serve` as a process: it starts from the command line, and SIGTERM lets the
request in flight finish before it exits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from serve_support import MODEL_ID, client, get, make_base

TOKENS = 400


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_finishes_the_stream_in_flight_then_exits(tmp_path):
    base = make_base(tmp_path)
    port = free_port()
    cmd = [sys.executable, "-m", "clew", "serve", "--model", str(base), "--model-id", MODEL_ID]
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [*cmd, "--port", str(port), "--device", "cpu"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while get_status(f"{url}/ready") != 200:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "clew serve did not become ready"
            time.sleep(0.2)
        stream = client(url).chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": "Which way?"}],
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            extra_body={"allowed_tokens": ["up", "down"]},  # no end token: it runs to the limit
        )
        chunks = iter(stream)
        before = [next(chunks) for _ in range(3)]
        proc.send_signal(signal.SIGTERM)
        after = list(chunks)
        text = "".join(c.choices[0].delta.content or "" for c in before + after if c.choices)
        assert any(c.choices and c.choices[0].delta.content for c in after)
        assert after[-1].choices[0].finish_reason == "length"
        assert text.count("up") + text.count("down") == TOKENS
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def get_status(url: str) -> int | None:
    try:
        return get(url)[0]
    except OSError:
        return None
