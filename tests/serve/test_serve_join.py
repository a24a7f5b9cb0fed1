"""Continuous batching in `clew serve`, through the real `openai` client: requests that arrive
while a batch runs join it between decode steps and finish before it, with the replies they
get alone; a request the KV-cache budget cannot hold beside the running rows waits."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
from support.serve_cases import MODEL_ID, client, image_message, make_base, make_prefix, serving

TEXT = [{"role": "user", "content": "Which way to the goal?"}]
MOVES = {"allowed_tokens": ["up", "down", "left", "right"]}  # no stop token: runs to length


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("serve-join")
    base = make_base()
    return base, make_prefix(base, root)


def _server(base, prefix=None, **open_kw):
    from clew.serve.server import Server, ServeSettings

    settings = ServeSettings(model_id=MODEL_ID, adapters=prefix and str(prefix))
    return Server.open(str(base), settings, device="cpu", **open_kw)


def _ask(c, model, messages, max_tokens):
    r = c.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=MOVES
    )
    return r.choices[0].message.content


def _batches(server) -> float:
    return server.metrics.registry.get_sample_value("clew_serve_batches_total") or 0.0


class _LongStream:
    """A long streamed request on its own thread: its text, and when its first and last
    deltas came."""

    def __init__(self, c, model: str, max_tokens: int) -> None:
        self.text = ""
        self.started = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(c, model, max_tokens))
        self._thread.start()

    def _run(self, c, model, max_tokens) -> None:
        stream = c.chat.completions.create(
            model=model,
            messages=TEXT,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body=MOVES,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                self.text += chunk.choices[0].delta.content
                self.started.set()
        self.done.set()

    def join(self) -> str:
        self._thread.join(120)
        return self.text


def test_requests_that_arrive_mid_batch_join_it_and_finish_first_with_their_alone_replies(tiny):
    base, prefix = tiny
    server = _server(base, prefix)
    with serving(server) as url:
        c = client(url)
        shorts = [
            (f"{MODEL_ID}:alpha", [image_message()], 6),
            (f"{MODEL_ID}:beta", TEXT, 4),
            (MODEL_ID, [image_message("Go on.")], 8),
        ]
        alone = [_ask(c, *job) for job in shorts]
        long_alone = _ask(c, MODEL_ID, TEXT, 300)
        batches = _batches(server)
        long = _LongStream(c, MODEL_ID, 300)
        assert long.started.wait(60), "the long request never streamed"
        with concurrent.futures.ThreadPoolExecutor(len(shorts)) as pool:
            together = list(pool.map(lambda job: _ask(c, *job), shorts))
        finished_first = not long.done.is_set()
        assert long.join() == long_alone
    assert together == alone
    assert finished_first, "the short requests waited for the long one to end"
    # They joined the long request's batch rather than opening their own.
    assert _batches(server) - batches == 1


def test_a_request_the_budget_cannot_hold_beside_the_running_rows_waits_for_them(tiny):
    base, _ = tiny
    from clew.inference.kv_cache import kv_bytes_per_token

    server = _server(base, max_cache_mb=1)
    per_token = kv_bytes_per_token(server.engine.model)
    long_tokens = (2**20 // per_token) * 2 // 3  # fits alone, not twice
    with serving(server) as url:
        c = client(url)
        alone = _ask(c, MODEL_ID, [image_message()], 4)
        long = _LongStream(c, MODEL_ID, long_tokens)
        assert long.started.wait(60), "the long request never streamed"
        short = _ask(c, MODEL_ID, [image_message()], 4)
        assert long.done.is_set(), "the short request ran beside a row it has no room for"
        long.join()
    assert short == alone
