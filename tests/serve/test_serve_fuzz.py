"""A property-based fuzz of `clew serve`'s HTTP API: schemathesis generates requests from the
server's own OpenAPI schema, valid ones and ones that break it; no answer may be a 5xx, and
every status and error body must be one the schema documents for that route. The number of
examples is bounded (``MAX_EXAMPLES`` per route and mode, the same ones every run), so the
file runs in CI in well under a minute.

The schema is read from the live server inside the test and each operation's strategy is run
with hypothesis directly (schemathesis' pytest loader, ``from_fixture``, does not run under
pytest 9)."""

from __future__ import annotations

import pytest
from support.serve_cases import MODEL_ID, make_adapter, make_base, open_server, serving

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    response_schema_conformance,
    status_code_conformance,
)

MAX_EXAMPLES = 60  # per operation and mode: about 25 s for the file on 2 CPUs
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def live_url(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("serve-fuzz")
    base = make_base()
    make_adapter(base, root / "adapters" / "alpha", rank=4, seed=1)
    # Small limits keep a valid request's generation short, so the examples stay fast.
    server = open_server(
        base,
        adapters=str(root / "adapters"),
        max_model_len=192,
        default_max_tokens=4,
        max_n=2,
    )
    with serving(server) as url:
        yield url


def operations(url: str) -> list:
    loaded = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in loaded.get_all_operations()]


def test_the_fuzz_covers_every_route_of_the_api(live_url):
    labels = {op.label for op in operations(live_url)}
    assert {
        "POST /v1/chat/completions",
        "GET /v1/models",
        "GET /v1/models/{model_id}",
        "GET /health",
        "GET /ready",
        "GET /metrics",
    } <= labels


def test_the_schema_documents_the_errors_each_route_sends_and_no_422(live_url):
    import json

    from support.serve_cases import get

    paths = json.loads(get(f"{live_url}/openapi.json")[1])["paths"]
    codes = {
        (path, method): set(op["responses"])
        for path, ops in paths.items()
        for method, op in ops.items()
    }
    assert not any("422" in c for c in codes.values()), codes
    assert {"400", "401", "404", "413", "500", "503"} <= codes[("/v1/chat/completions", "post")]
    assert {"400", "409", "413"} <= codes[("/playground/api/episodes/step", "post")]
    assert {"404"} <= codes[("/v1/models/{model_id}", "get")]
    error = paths["/v1/chat/completions"]["post"]["responses"]["400"]["content"]
    assert "ErrorBody" in json.dumps(error)


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_request_the_schema_allows_or_breaks_gets_a_server_error(live_url, mode):
    generation = schemathesis.GenerationMode(mode)
    seen: dict[str, set[int]] = {}
    for op in operations(live_url):
        # A name the server knows, for most requests: random names stop at the 404, before
        # the prompt is encoded and generated.
        known = st.sampled_from([None, MODEL_ID, f"{MODEL_ID}:alpha", f"{MODEL_ID}:alpha"])

        @given(case=op.as_strategy(generation_mode=generation), model=known)
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,  # the same examples every run: a failure reproduces
            database=None,
        )
        def no_server_error(case, model: str | None) -> None:
            if model and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = model
            response = case.call(base_url=live_url, timeout=30)
            seen.setdefault(case.operation.label, set()).add(response.status_code)
            if response.status_code >= 400:  # an error body as the schema documents it
                case.validate_response(response, checks=CHECKS)
            else:
                case.validate_response(response, checks=CHECKS[:2])

        try:
            no_server_error()
        except Unsatisfiable:  # nothing to break: a route without parameters or body
            assert generation is schemathesis.GenerationMode.NEGATIVE and op.method == "get"
    assert all(code < 500 for codes in seen.values() for code in codes), seen
    # Refused, and in valid mode also served: the fuzz reached the engine, not just validation.
    chat = seen["POST /v1/chat/completions"]
    assert any(400 <= code < 500 for code in chat), chat
    if generation is schemathesis.GenerationMode.POSITIVE:
        assert 200 in chat, chat
