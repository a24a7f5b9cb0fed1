"""`clew serve` as a process: it starts from the command line; SIGTERM lets the request in
flight finish before it exits, and one that cannot finish within `--shutdown-timeout` is
answered with a 503 in OpenAI's format while the process exits within the timeout and a
few seconds."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from support.serve_cases import MODEL_ID, client, get, make_base, post

TOKENS = 400


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def clew_serve(tmp_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``clew serve`` of a tiny base as a process, ready; yields it and its URL."""
    base = make_base()
    port = free_port()
    cmd = [sys.executable, "-m", "clew", "serve", "--model", str(base), "--model-id", MODEL_ID]
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [*cmd, "--port", str(port), "--device", "cpu", *flags],
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
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_finishes_the_stream_in_flight_then_exits(tmp_path):
    with clew_serve(tmp_path) as (proc, url):
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
    log = (tmp_path / "serve.log").read_text()
    assert "no API key is set" in log and f"serving {MODEL_ID}" in log


def test_requests_past_the_shutdown_timeout_get_a_503_and_the_process_exits_in_time(tmp_path):
    timeout = 2.0
    with clew_serve(tmp_path, "--shutdown-timeout", str(timeout)) as (proc, url):
        body = {
            "model": MODEL_ID,
            "messages": [{"role": "user", "content": "Which way?"}],
            "max_tokens": 30000,  # minutes of tokens on a CPU
            "temperature": 0,
            "allowed_tokens": ["up", "down"],
        }
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            whole = pool.submit(post, f"{url}/v1/chat/completions", body)
            streamed = pool.submit(stream_events, url, body)
            deadline = time.monotonic() + 60
            while running(url) < 2:
                assert time.monotonic() < deadline, "the requests never ran"
                time.sleep(0.1)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout + 10)
            took = time.monotonic() - sent
            status, reply = whole.result(10)
            events = streamed.result(10)
    assert took < timeout + 8, f"the process took {took:.1f}s to exit after SIGTERM"
    assert status == 503 and reply["error"]["code"] == "shutting_down", reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["error"]["code"] == "shutting_down", events[-1]


def running(url: str) -> float:
    status, text = get(f"{url}/metrics")
    for line in text.decode().splitlines():
        if line.startswith("clew_serve_running_sequences "):
            return float(line.split()[1])
    return 0.0


def stream_events(url: str, body: dict) -> list[dict]:
    """The JSON events of a streamed request, read until the server closes it."""
    import urllib.request

    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: ") :]))
    return events


def get_status(url: str) -> int | None:
    try:
        return get(url)[0]
    except OSError:
        return None
