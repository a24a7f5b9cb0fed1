"""What a client can make `clew serve` hold or say is bounded: metric labels only for served
models, short error messages without the server's paths, only loadable adapters listed,
adapters reloaded when their files change, an X-Request-Id on every response, and a
startup log that says what is served, within which limits, and whether anyone may use it."""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import time
from urllib.parse import urlparse

import pytest
from support.serve_cases import (
    MODEL_ID,
    add_corrupt,
    get,
    image_message,
    make_adapter,
    make_base,
    open_server,
    post,
    serving,
)
from support.tiny import wide_policy

TEXT = [{"role": "user", "content": "Which way to the goal?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("serve-bounds")
    base = make_base()
    prefix = root / "adapters"
    make_adapter(base, prefix / "alpha", rank=4, seed=1)
    make_adapter(base, prefix / "gamma", rank=2, seed=3)
    add_corrupt(prefix)
    wide = wide_policy()
    make_adapter(wide, prefix / "misfit", rank=4, seed=2)
    return base, prefix


@pytest.fixture(scope="module")
def served(tiny):
    base, prefix = tiny
    server = open_server(base, adapters=str(prefix))
    with serving(server) as url:
        yield server, url


def ask(url: str, model: str, **over) -> tuple[int, dict]:
    body = {"model": model, "messages": TEXT, "max_tokens": 4, "temperature": 0, **over}
    return post(f"{url}/v1/chat/completions", body)


def listed(url: str) -> list[str]:
    return [m["id"] for m in json.loads(get(f"{url}/v1/models")[1])["data"]]


def test_metrics_stay_bounded_after_thousands_of_unknown_adapter_names(served):
    server, url = served
    assert ask(url, f"{MODEL_ID}:alpha")[0] == 200
    before = len(get(f"{url}/metrics")[1])
    where = urlparse(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    for i in range(2000):
        body = json.dumps({"model": f"{MODEL_ID}:nobody-{i}", "messages": TEXT}).encode()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        assert response.status == 404
    conn.close()
    text = get(f"{url}/metrics")[1]
    assert len(text) < before + 1024, (before, len(text))
    assert b"nobody" not in text
    unknown = {"model": "unknown", "status": "404"}
    counted = server.metrics.registry.get_sample_value("clew_serve_requests_total", unknown)
    assert counted >= 2000
    assert server.metrics.registry.get_sample_value(
        "clew_serve_requests_total", {"model": "alpha", "status": "200"}
    )


def test_a_404_or_400_does_not_echo_a_huge_name(served):
    _, url = served
    huge = "x" * (1 << 20)
    for model, status in ((huge, 404), (f"{MODEL_ID}:{huge}", 400), (f"{MODEL_ID}:a{huge}b", 400)):
        got, body = ask(url, model)
        assert got == status, body
        assert len(json.dumps(body)) < 4096 and "1,048,5" in body["error"]["message"]
    got, raw = get(f"{url}/v1/models/{huge[:6000]}")  # a URL as long as HTTP servers take
    assert got == 404 and len(raw) < 4096 and b"6,000 characters" in raw


def test_adapters_that_cannot_load_are_not_listed_nor_tell_the_servers_paths(served, tiny):
    _, prefix = tiny
    _, url = served
    # A config with weights that are not safetensors: left out when listed.
    assert f"{MODEL_ID}:broken" not in listed(url)
    # Trained on another base: listed until a load fails, then left out until its files change.
    assert f"{MODEL_ID}:misfit" in listed(url)
    for name in ("broken", "misfit"):
        status, body = ask(url, f"{MODEL_ID}:{name}")
        assert status == 500 and body["error"]["code"] == "adapter_load_failed", body
        message = body["error"]["message"]
        assert name in message and str(prefix) not in message and "/tmp" not in message
        assert str(prefix.parent) not in message, message
    assert listed(url) == [MODEL_ID, f"{MODEL_ID}:alpha", f"{MODEL_ID}:gamma"]


def test_an_adapter_whose_files_are_overwritten_is_served_from_the_new_files(tiny, tmp_path):
    base, prefix = tiny
    live = tmp_path / "live"
    shutil.copytree(prefix / "alpha", live / "current")
    server = open_server(base, adapters=str(live), adapter_check_s=0.0)
    with serving(server) as url:
        first = ask(url, f"{MODEL_ID}:current", messages=[image_message()])
        assert first[0] == 200
        for f in (prefix / "gamma").iterdir():  # a new export over the old one
            shutil.copy(f, live / "current" / f.name)
        time.sleep(0.01)
        again = ask(url, f"{MODEL_ID}:current", messages=[image_message()])
        gamma = ask(url, f"{MODEL_ID}:gamma", messages=[image_message()])  # not served here
    with serving(open_server(base, adapters=str(prefix))) as url:
        want = ask(url, f"{MODEL_ID}:gamma", messages=[image_message()])
    assert gamma[0] == 404
    text = [r[1]["choices"][0]["message"]["content"] for r in (first, again, want)]
    assert text[1] == text[2] != text[0]
    assert server.adapters.loads == 2 and server.adapters.evictions == 1


def test_every_response_carries_an_x_request_id(served):
    import urllib.request

    _, url = served

    def request_id(path: str, data: bytes | None = None, rid: str | None = None) -> str:
        req = urllib.request.Request(f"{url}{path}", data=data, method="POST" if data else "GET")
        req.add_header("Content-Type", "application/json")
        if rid is not None:
            req.add_header("X-Request-Id", rid)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.headers["X-Request-Id"]
        except urllib.error.HTTPError as err:
            return err.headers["X-Request-Id"]

    good = json.dumps({"model": MODEL_ID, "messages": TEXT, "max_tokens": 2}).encode()
    ids = [
        request_id("/v1/chat/completions", good),
        request_id("/v1/chat/completions", b"{not json"),
        request_id("/v1/models/nope"),
        request_id("/health"),
        request_id("/metrics"),
        request_id("/no/such/route"),
    ]
    assert all(i and i.startswith("req-") for i in ids) and len(set(ids)) == len(ids)
    assert request_id("/health", rid="trace-42.a:b") == "trace-42.a:b"
    for bad in ("x" * 500, "has space", "semi;colon"):
        assert request_id("/health", rid=bad).startswith("req-")


def test_key_and_size_refusals_carry_a_request_id_too(tiny):
    base, _ = tiny
    server = open_server(base, api_key="k", max_request_bytes=1000)
    with serving(server) as url:
        import urllib.request

        for data, headers, status in (
            (b"{}", {}, 401),
            (b"x" * 2000, {"Authorization": "Bearer k"}, 413),
        ):
            req = urllib.request.Request(f"{url}/v1/chat/completions", data=data, headers=headers)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=30)
            assert err.value.code == status and err.value.headers["X-Request-Id"]


def test_startup_logs_the_model_the_adapter_prefix_the_limits_and_a_missing_key(tiny, caplog):
    base, prefix = tiny
    server = open_server(base, adapters=str(prefix), max_n=3)
    with caplog.at_level(logging.INFO, logger="clew.serve"), serving(server):
        pass
    text = caplog.text
    assert "no API key is set" in text
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("serving"))
    assert MODEL_ID in line and str(prefix) in line
    for limit in ("max_model_len=", "max_n=3", "max_images=8", "max_request_bytes="):
        assert limit in line, line
    caplog.clear()
    server = open_server(base, api_key="secret")
    with caplog.at_level(logging.INFO, logger="clew.serve"), serving(server):
        pass
    assert "no API key" not in caplog.text and "adapters off" in caplog.text
