"""`clew serve` through the real `openai` client on loopback: base and adapters, text and
images, streaming, batching, the adapter LRU, S3 prefixes and the API key."""

from __future__ import annotations

import concurrent.futures
import time
import uuid

import openai
import pytest
from support.s3_server import s3_bucket, s3_endpoint  # noqa: F401  (fixtures)
from support.serve_cases import (
    MODEL_ID,
    add_corrupt,
    client,
    get,
    image_message,
    make_base,
    make_prefix,
    open_server,
    serving,
)

TEXT = [{"role": "user", "content": "Which way to the goal?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("serve")
    base = make_base()
    prefix = make_prefix(base, root)
    add_corrupt(prefix)
    return base, prefix


@pytest.fixture(scope="module")
def local(tiny):
    """(server, url): the tiny base with the local prefix, two adapters held at once."""
    base, prefix = tiny
    server = open_server(base, adapters=str(prefix), max_adapters=2)
    with serving(server) as url:
        yield server, url


def reply(c, model, messages=TEXT, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return c.chat.completions.create(model=model, messages=messages, **kw)


def sample(server, name, labels=None):
    return server.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_models_lists_the_base_and_every_loadable_adapter_under_the_prefix(local):
    _, url = local
    ids = [m.id for m in client(url).models.list()]
    # `broken` has a config but weights that are not safetensors: not listed.
    assert ids == [MODEL_ID] + [f"{MODEL_ID}:{n}" for n in ("alpha", "beta", "gamma")]
    assert client(url).models.retrieve(f"{MODEL_ID}:beta").id == f"{MODEL_ID}:beta"


def test_text_and_image_requests_answer_with_usage(local):
    server, url = local
    c = client(url)
    for messages in (TEXT, [image_message()]):
        r = reply(c, MODEL_ID, messages, max_tokens=7)
        choice = r.choices[0]
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert r.usage.completion_tokens <= 7
        assert choice.finish_reason == ("length" if r.usage.completion_tokens == 7 else "stop")
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    image_prompt = r.usage.prompt_tokens
    assert image_prompt > reply(c, MODEL_ID, TEXT).usage.prompt_tokens  # the image's tokens count


def test_adapters_change_the_reply_and_greedy_replies_repeat(local):
    _, url = local
    c = client(url)
    texts = {m: reply(c, MODEL_ID + m).choices[0].message.content for m in ("", ":alpha", ":beta")}
    assert len(set(texts.values())) == 3, texts
    assert reply(c, f"{MODEL_ID}:alpha").choices[0].message.content == texts[":alpha"]


def test_concurrent_requests_for_base_and_two_adapters_share_one_batch_and_match_each_alone(
    local,
):
    server, url = local
    c = client(url)
    jobs = [
        (model, messages)
        for model in (MODEL_ID, f"{MODEL_ID}:alpha", f"{MODEL_ID}:beta")
        for messages in (TEXT, [image_message()], [image_message("Go on.", None)])
    ]
    alone = [reply(c, m, msgs).choices[0].message.content for m, msgs in jobs]
    before = sample(server, "clew_serve_batches_total")
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        # Held until all nine have queued, so they arrive at the scheduler at once.
        with server.scheduler.holding():
            futures = [
                pool.submit(lambda j: reply(c, *j).choices[0].message.content, j) for j in jobs
            ]
            deadline = time.monotonic() + 60
            while sample(server, "clew_serve_queue_depth") < len(jobs):
                assert time.monotonic() < deadline, "the requests never all queued"
                time.sleep(0.01)
        together = [f.result() for f in futures]
    assert together == alone
    assert sample(server, "clew_serve_batches_total") - before == 1


def test_stream_deltas_join_to_the_whole_reply_with_usage_last(local):
    _, url = local
    c = client(url)
    whole = reply(c, f"{MODEL_ID}:alpha", max_tokens=10)
    stream = reply(
        c, f"{MODEL_ID}:alpha", max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_stop_strings_cut_the_reply_before_them(local):
    _, url = local
    c = client(url)
    full = reply(c, f"{MODEL_ID}:beta", max_tokens=24).choices[0].message.content
    stop = full[6:9]
    assert len(stop) == 3
    cut = full[: full.find(stop)]
    r = reply(c, f"{MODEL_ID}:beta", max_tokens=24, stop=[stop, "never-there"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (cut, "stop")
    streamed = reply(c, f"{MODEL_ID}:beta", max_tokens=24, stop=stop, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == cut


def test_a_seed_repeats_a_sampled_reply_and_n_gives_n_choices(local):
    _, url = local
    c = client(url)
    kw = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 16, "n": 3}
    first = reply(c, MODEL_ID, seed=7, **kw)
    again = reply(c, MODEL_ID, seed=7, **kw)
    assert [ch.index for ch in first.choices] == [0, 1, 2]
    assert [ch.message.content for ch in first.choices] == [
        ch.message.content for ch in again.choices
    ]
    assert first.usage.prompt_tokens == again.usage.prompt_tokens  # counted once for n


def test_allowed_tokens_keep_the_reply_to_those_tokens(local):
    _, url = local
    r = reply(client(url), MODEL_ID, max_tokens=6, extra_body={"allowed_tokens": ["up", "down"]})
    assert r.choices[0].message.content.replace("up", "").replace("down", "") == ""
    assert r.usage.completion_tokens == 6


def test_a_client_that_leaves_a_stream_frees_its_rows(local):
    server, url = local
    stream = reply(
        client(url), MODEL_ID, max_tokens=5000, stream=True, extra_body={"allowed_tokens": ["up"]}
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while sample(server, "clew_serve_running_sequences") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sample(server, "clew_serve_running_sequences") == 0


def test_unknown_models_and_adapters_are_404s_naming_the_available_ones(local):
    _, url = local
    for model in ("gpt-4o", f"{MODEL_ID}:missing", f"{MODEL_ID}-other"):
        with pytest.raises(openai.NotFoundError) as err:
            reply(client(url), model)
        assert err.value.body["code"] == "model_not_found"
        assert f"{MODEL_ID}:alpha" in err.value.body["message"]


@pytest.mark.parametrize("name", ["../alpha", "..", "/etc", "alpha/../../x", "a\\b", ".hidden", ""])
def test_adapter_names_that_could_leave_the_prefix_are_refused(local, name):
    _, url = local
    with pytest.raises(openai.BadRequestError, match="not a valid adapter name"):
        reply(client(url), f"{MODEL_ID}:{name}")


def test_a_link_out_of_a_local_prefix_is_not_an_adapter(tiny, tmp_path):
    base, prefix = tiny
    outside = tmp_path / "outside"
    outside.mkdir()
    for f in (prefix / "alpha").iterdir():
        (outside / f.name).write_bytes(f.read_bytes())
    linked = tmp_path / "prefix"
    linked.mkdir()
    (linked / "escape").symlink_to(outside, target_is_directory=True)
    with serving(open_server(base, adapters=str(linked))) as url:
        assert [m.id for m in client(url).models.list()] == [MODEL_ID]
        with pytest.raises(openai.NotFoundError):
            reply(client(url), f"{MODEL_ID}:escape")


def test_a_corrupt_adapter_fails_its_requests_only(local):
    server, url = local
    c = client(url)
    with pytest.raises(openai.InternalServerError) as err:
        reply(c, f"{MODEL_ID}:broken")
    assert err.value.body["code"] == "adapter_load_failed" and "broken" in err.value.body["message"]
    assert reply(c, f"{MODEL_ID}:alpha").choices[0].message.content
    assert reply(c, MODEL_ID).choices[0].message.content
    assert sample(server, "clew_serve_adapter_load_failures_total") >= 1


def test_the_least_recently_used_adapter_is_evicted_and_reloads_the_same(local):
    server, url = local
    c = client(url)
    first = reply(c, f"{MODEL_ID}:alpha").choices[0].message.content
    reply(c, f"{MODEL_ID}:beta")
    assert server.adapters.names() == ["alpha", "beta"]
    evicted = sample(server, "clew_serve_adapter_evictions_total", {"adapter": "alpha"})
    loads = sample(server, "clew_serve_adapter_loads_total", {"adapter": "alpha"})
    reply(c, f"{MODEL_ID}:gamma")  # the third: alpha, least recently used, goes
    assert server.adapters.names() == ["beta", "gamma"]
    after = sample(server, "clew_serve_adapter_evictions_total", {"adapter": "alpha"})
    assert after == evicted + 1
    assert reply(c, f"{MODEL_ID}:alpha").choices[0].message.content == first
    assert sample(server, "clew_serve_adapter_loads_total", {"adapter": "alpha"}) == loads + 1
    assert server.adapters.names() == ["gamma", "alpha"]


def test_adapters_that_running_rows_use_are_not_evicted_for_a_third(local):
    server, url = local
    c = client(url)
    alone = {n: reply(c, f"{MODEL_ID}:{n}").choices[0].message.content for n in ("alpha", "beta")}
    alone["gamma"] = reply(c, f"{MODEL_ID}:gamma").choices[0].message.content
    assert server.adapters.names() == ["beta", "gamma"]
    order = ["beta", "gamma", "alpha"]  # alpha, fetched by its request, waits only for room
    before = sample(server, "clew_serve_batches_total")
    with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
        futures = []
        with server.scheduler.holding():
            for n in order:  # one by one, so they queue in this order
                futures.append(
                    pool.submit(lambda n: reply(c, f"{MODEL_ID}:{n}").choices[0].message.content, n)
                )
                deadline = time.monotonic() + 60
                while sample(server, "clew_serve_queue_depth") < len(futures):
                    assert time.monotonic() < deadline, "the request never queued"
                    time.sleep(0.01)
        together = [f.result() for f in futures]
    # Two adapters fit: alpha waited for the batch of beta and gamma to end, not evicting one.
    assert together == [alone[n] for n in order]
    assert sample(server, "clew_serve_batches_total") - before == 2


def test_health_readiness_and_metrics(local):
    server, url = local
    assert get(f"{url}/health")[0] == 200
    assert get(f"{url}/ready")[0] == 200
    status, text = get(f"{url}/metrics")
    assert status == 200
    for name in (
        "clew_serve_requests_total",
        "clew_serve_request_latency_seconds",
        "clew_serve_completion_tokens_total",
        "clew_serve_queue_depth",
        "clew_serve_adapter_loads_total",
    ):
        assert name.encode() in text
    assert sample(server, "clew_serve_requests_total", {"model": "base", "status": "200"}) >= 1
    server.draining = True  # what SIGTERM sets first
    try:
        assert get(f"{url}/ready")[0] == 503 and get(f"{url}/health")[0] == 200
    finally:
        server.draining = False


def test_an_s3_prefix_with_an_api_key_serves_the_same_adapters(
    tiny,
    local,
    s3_bucket,  # noqa: F811
    s3_endpoint,  # noqa: F811
    monkeypatch,
):
    from clew.checkpoint import Storage

    base, prefix = tiny
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    root = f"s3://{s3_bucket}/{uuid.uuid4().hex}/adapters"
    storage = Storage.for_path(root)
    for name in ("alpha", "beta"):
        storage.put_dir(prefix / name, f"{root}/{name}")
    server = open_server(base, adapters=root, api_key="s3cret")
    with serving(server) as url:
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        c = client(url, "s3cret")
        assert [m.id for m in c.models.list()] == [
            MODEL_ID,
            f"{MODEL_ID}:alpha",
            f"{MODEL_ID}:beta",
        ]
        _, local_url = local
        for model in (f"{MODEL_ID}:alpha", f"{MODEL_ID}:beta"):
            want = reply(client(local_url), model, [image_message()]).choices[0].message.content
            assert reply(c, model, [image_message()]).choices[0].message.content == want
        assert get(f"{url}/health")[0] == 200  # probes need no key


def test_several_tokens_a_step_give_the_replies_and_usage_of_one(tiny, local):
    base, prefix = tiny
    _, one_url = local
    one = client(one_url)
    full = reply(one, f"{MODEL_ID}:beta", max_tokens=24).choices[0].message.content
    asks = [
        {"model": MODEL_ID, "max_tokens": 11},
        {"model": f"{MODEL_ID}:alpha", "max_tokens": 7, "messages": [image_message()]},
        {"model": f"{MODEL_ID}:beta", "max_tokens": 24, "stop": full[5:8]},
    ]
    with serving(open_server(base, adapters=str(prefix), tokens_per_step=4)) as url:
        four = client(url)
        for ask in asks:
            a, b = reply(one, **ask), reply(four, **ask)
            assert a.choices[0].message.content == b.choices[0].message.content
            assert a.choices[0].finish_reason == b.choices[0].finish_reason
            assert a.usage == b.usage
