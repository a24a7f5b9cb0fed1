"""``clew.serve:build_app`` deployed on a local Ray instance (loopback), asked by the openai
client through Ray Serve's proxy. About 15 s: Ray, then Serve, then one tiny replica."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from support.serve_cases import MODEL_ID, client, image_message, make_adapter, make_base

pytestmark = pytest.mark.ray

API_KEY = "ray-serve-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_serve_url(tmp_path_factory):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from clew.serve import build_app

    root: Path = tmp_path_factory.mktemp("ray_serve")
    base = make_base()
    make_adapter(base, root / "adapters" / "alpha", rank=4, seed=1)
    started = not ray.is_initialized()
    if started:
        from clew.ray_connect import start_local_ray

        # A Ray of the module's own on loopback, whatever cluster the machine has or had.
        # The replica reads its API key from the environment, as on Kubernetes.
        start_local_ray(
            2,
            log_to_driver=False,
            runtime_env={"env_vars": {"CLEW_SERVE_API_KEY": API_KEY}},
        )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": str(base),
        "model_id": MODEL_ID,
        "adapters": str(root / "adapters"),
        "max_adapters": 1,
        "require_api_key": True,
        "device": "cpu",
        "max_cache_mb": 64,
    }
    serve.run(build_app(args), name="clew", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()


def test_the_ray_serve_app_answers_the_openai_client_with_its_key(ray_serve_url):
    import openai

    with pytest.raises(openai.AuthenticationError):
        client(ray_serve_url, api_key="wrong").models.list()
    api = client(ray_serve_url, api_key=API_KEY)
    assert {m.id for m in api.models.list()} == {MODEL_ID, f"{MODEL_ID}:alpha"}
    reply = api.chat.completions.create(
        model=f"{MODEL_ID}:alpha",
        messages=[image_message()],
        max_tokens=6,
        temperature=0,
    )
    assert reply.model == f"{MODEL_ID}:alpha"
    assert reply.choices[0].finish_reason in {"stop", "length"}
    assert 1 <= reply.usage.completion_tokens <= 6
    assert reply.usage.prompt_tokens > 0
