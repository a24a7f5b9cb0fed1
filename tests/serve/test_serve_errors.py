"""`clew serve` refuses bad requests with OpenAI-style 4xx bodies, never a 500."""

from __future__ import annotations

import base64
import io
import json

import openai
import pytest
from PIL import Image
from support.serve_cases import (
    MODEL_ID,
    client,
    get,
    image_message,
    make_adapter,
    make_base,
    open_server,
    png_url,
    post,
    serving,
)
from support.tiny import wide_policy

MAX_IMAGE_BYTES = 60_000
MAX_REQUEST_BYTES = 400_000
MAX_MODEL_LEN = 256
MAX_IMAGE_PIXELS = 1 << 20


@pytest.fixture(scope="module")
def url(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("serve-errors")
    base = make_base()
    make_adapter(base, root / "adapters" / "fits", rank=4, seed=1)
    wide = wide_policy()
    make_adapter(wide, root / "adapters" / "misfit", rank=4, seed=2)
    from clew.serve.prompt import PromptLimits

    server = open_server(
        base,
        adapters=str(root / "adapters"),
        max_model_len=MAX_MODEL_LEN,
        max_n=4,
        max_request_bytes=MAX_REQUEST_BYTES,
        limits=PromptLimits(
            max_images=2, max_image_bytes=MAX_IMAGE_BYTES, max_image_pixels=MAX_IMAGE_PIXELS
        ),
    )
    with serving(server) as u:
        yield u


def body(**over):
    out = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out.update(over)
    return out


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def png_bytes(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (9, 9, 9)).save(buf, "PNG")
    return buf.getvalue()


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def image(url):
    return {"type": "image_url", "image_url": {"url": url}}


NOISE = bytes(range(256)) * (MAX_IMAGE_BYTES // 256 + 8)

BAD = {
    "malformed JSON": b'{"model": "x", "messages": [',
    "a list, not an object": b"[1, 2]",
    "no messages": body(messages=[]),
    "messages as a string": body(messages="hi"),
    "temperature as a string": body(temperature="hot"),
    "temperature out of range": body(temperature=3.5),
    "top_p of zero": body(top_p=0),
    "max_tokens of zero": body(max_tokens=0),
    "max_tokens as a float": body(max_tokens=2.5),
    "n over the limit": body(n=5),
    "five stop strings": body(stop=["a", "b", "c", "d", "e"]),
    "an empty stop string": body(stop=[""]),
    "an unknown role": body(messages=[{"role": "robot", "content": "hi"}]),
    "an unknown part type": body(messages=user({"type": "input_audio", "input_audio": {}})),
    "only a system message": body(messages=[{"role": "system", "content": "be brief"}]),
    "an assistant message last": body(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ),
    "a system message late": body(
        messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]
    ),
    "an image in an assistant message": body(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [image(png_url())]},
            {"role": "user", "content": "and?"},
        ]
    ),
    "too many images": body(messages=user(*[image(png_url())] * 3)),
    "an oversized image": body(messages=user(image(data_url(NOISE)))),
    "an image of too many pixels": body(messages=user(image(data_url(png_bytes((2048, 1024)))))),
    "an image the processor refuses": body(messages=user(image(data_url(png_bytes((1, 3000)))))),
    "an undecodable image": body(messages=user(image(data_url(b"not an image at all")))),
    "invalid base64": body(messages=user(image("data:image/png;base64,@@@not-base64@@@"))),
    "a data URL without base64": body(messages=user(image("data:image/png,rawbytes"))),
    "a remote image URL": body(messages=user(image("http://127.0.0.1:9/cat.png"))),
    "a file URL": body(messages=user(image("file:///etc/passwd"))),
    "a prompt over the context": body(messages=[{"role": "user", "content": "go " * 400}]),
    "max_tokens over the context": body(max_tokens=MAX_MODEL_LEN + 1),
    "logprobs": body(logprobs=True),
    "tools": body(tools=[{"type": "function", "function": {"name": "f"}}]),
    "an allowed token that is two tokens": body(allowed_tokens=["up down"]),
    "an invalid adapter name": body(model=f"{MODEL_ID}:../../etc"),
}


# What the refusal must say, where the case has a reason of its own (code or message).
REASON = {
    "malformed JSON": "invalid_json",
    "temperature as a string": "temperature: Input should be a valid number",
    "too many images": "too_many_images",
    "an oversized image": "image_too_large",
    "an image of too many pixels": "2048 x 1024 pixels",
    "an image the processor refuses": "cannot be encoded for this model",
    "an undecodable image": "invalid_image",
    "invalid base64": "not valid base64",
    "a data URL without base64": "invalid_image_url",
    "a remote image URL": "remote_image_refused",
    "a file URL": "invalid_image_url",
    "a prompt over the context": "context_length_exceeded",
    "max_tokens over the context": "context_length_exceeded",
    "logprobs": "logprobs is not supported",
    "an allowed token that is two tokens": "not one token",
    "an invalid adapter name": "invalid_adapter_name",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_are_400s_with_an_openai_error_body(url, case):
    status, reply = post(f"{url}/v1/chat/completions", BAD[case])
    assert status == 400, (case, status, reply)
    err = reply["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if case in REASON:
        assert REASON[case] in (err["code"] or "") + err["message"], err


def test_over_long_context_errors_name_the_limit(url):
    status, reply = post(f"{url}/v1/chat/completions", BAD["a prompt over the context"])
    assert reply["error"]["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in reply["error"]["message"]


def test_a_body_over_the_size_limit_is_a_413(url):
    raw = json.dumps(body(user="x" * (MAX_REQUEST_BYTES + 10))).encode()
    status, reply = post(f"{url}/v1/chat/completions", raw)
    assert status == 413 and reply["error"]["code"] == "request_too_large"


def test_unknown_routes_and_methods_answer_in_openai_form(url):
    status, raw = get(f"{url}/v1/completions-nope")
    assert status == 404 and "error" in json.loads(raw)
    status, raw = get(f"{url}/v1/chat/completions")
    assert status == 405 and "error" in json.loads(raw)


def test_an_adapter_trained_on_another_base_fails_that_request_only(url):
    c = client(url)
    with pytest.raises(openai.InternalServerError) as err:
        c.chat.completions.create(
            model=f"{MODEL_ID}:misfit", messages=[image_message()], max_tokens=4
        )
    assert err.value.body["code"] == "adapter_load_failed"
    assert "does not fit the served base model" in err.value.body["message"]
    for model in (f"{MODEL_ID}:fits", MODEL_ID):
        r = c.chat.completions.create(model=model, messages=[image_message()], max_tokens=4)
        assert r.choices[0].message.content is not None


def test_the_refused_requests_left_the_server_serving(url):
    assert get(f"{url}/ready")[0] == 200
    status, _ = post(f"{url}/v1/chat/completions", body())
    assert status == 200
