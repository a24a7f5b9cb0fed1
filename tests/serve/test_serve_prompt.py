"""`clew serve` encodes a request's messages into the very ids the model's chat template gives
them (its text and image parts in the order sent), and the agent client sends an episode in
the layout its rollouts present it."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image
from support.serve_cases import make_base, open_server, served_prompt, serving

from clew.agent.endpoint import Reply
from clew.agent.episode import EpisodeTurns
from clew.inference.sampling import SamplingParams
from clew.models.chat import ChatFormat, Chunk
from clew.rollout.loop import RolloutSettings

MODELS = ("tiny_dir", "real_qwen3vl_dir")


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def image(width: int = 56, height: int | None = None, color=(20, 180, 40)) -> dict[str, Any]:
    buf = io.BytesIO()
    Image.new("RGB", (width, height or width), color).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


# Two images of different shapes, so that swapping them changes the ids and the grids.
WIDE, TALL = image(56, 28, (200, 30, 30)), image(28, 56, (30, 30, 200))

LAYOUTS: dict[str, list[dict[str, Any]]] = {
    "text, image": [{"role": "user", "content": [text("Where is the goal?"), image()]}],
    "image, text": [{"role": "user", "content": [image(), text("Where is the goal?")]}],
    "text, image, text": [
        {"role": "user", "content": [text("The maze:"), image(), text(" Which way now?")]}
    ],
    "images apart, adjacent texts": [
        {"role": "user", "content": [WIDE, text("Before, "), text("then after:"), TALL]}
    ],
    "system, history, consecutive users": [
        {"role": "system", "content": [text("You are "), text("navigating a maze.")]},
        {"role": "user", "content": [text("Start here."), WIDE]},
        {"role": "assistant", "content": "<action>up</action>"},
        {"role": "user", "content": "You moved up."},
        {"role": "user", "content": [TALL, text("What next?")]},
    ],
    "consecutive replies": [
        {"role": "user", "content": "Which way?"},
        {"role": "assistant", "content": "left"},
        {"role": "assistant", "content": [text("right"), text(" then up")]},
        {"role": "user", "content": [image(), text("And now?")]},
    ],
}


@pytest.fixture(scope="module")
def tiny_dir(one_thread) -> Path:
    return make_base()


@pytest.fixture(scope="module", params=MODELS)
def served(request) -> Iterator[tuple[Any, str, Any]]:
    """(server, url, processor) of each model: clew's tiny one, and a checkpoint with the
    genuine Qwen tokenizer and Qwen3-VL-Instruct's template where that fixture exists."""
    from clew.models import load_policy

    try:
        path = request.getfixturevalue(request.param)
    except pytest.FixtureLookupError:
        pytest.skip(f"no {request.param} fixture in this checkout")
    server = open_server(Path(path))
    with serving(server) as url:
        yield server, url, load_policy(path)[1]


def templated(processor: Any, messages: list[dict[str, Any]], *, continue_final: bool = False):
    """The ids (and image grids) of ``messages`` rendered by the model's own chat template,
    each image placeholder expanded to its image's tokens by the processor."""
    rendered = processor.tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
    )
    images = [
        Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1])))
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image_url"
    ]
    out = processor(text=[rendered], images=[im.convert("RGB") for im in images] or None)
    grid = out.get("image_grid_thw")
    return list(out["input_ids"][0]), None if grid is None else [list(g) for g in grid]


def grids(chunk: Chunk) -> list[list[int]] | None:
    return None if chunk.image_grid_thw is None else chunk.image_grid_thw.tolist()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_request_is_encoded_as_the_chat_template_renders_its_messages(served, layout):
    server, url, processor = served
    messages = LAYOUTS[layout]
    ids, grid = templated(processor, messages)
    prompt = served_prompt(server, url, messages)
    assert prompt.token_ids == [int(i) for i in ids]
    assert grids(prompt) == (None if grid is None else [[int(x) for x in g] for g in grid])


def test_a_continued_last_reply_is_encoded_as_the_template_continues_it(served):
    server, url, processor = served
    messages = [
        {"role": "system", "content": "Answer with one action."},
        {"role": "user", "content": [text("The maze:"), image(), text(" Which way?")]},
        {"role": "assistant", "content": "<action>"},
    ]
    ids, _ = templated(processor, messages, continue_final=True)
    prompt = served_prompt(server, url, messages, extra_body={"continue_final_message": True})
    assert prompt.token_ids == [int(i) for i in ids]


def test_swapping_a_messages_parts_changes_its_prompt(served):
    server, url, _ = served
    one = served_prompt(server, url, [{"role": "user", "content": [WIDE, text("go"), TALL]}])
    other = served_prompt(server, url, [{"role": "user", "content": [TALL, text("go"), WIDE]}])
    assert grids(one) == grids(other)[::-1] != grids(other)


def test_a_user_message_without_content_is_an_empty_turn(served):
    server, url, _ = served
    none = served_prompt(server, url, [{"role": "user", "content": None}])
    assert none.token_ids == served_prompt(server, url, [{"role": "user", "content": ""}]).token_ids


class _PromptedEnv:
    """A two-turn env whose observations carry their layout (``text_first``) and a system
    prompt, as an env's prompt format gives them."""

    max_turns = 2

    def __init__(self, text_first: bool) -> None:
        self.text_first = text_first

    def _obs(self, text: str, color: tuple[int, int, int]) -> Any:
        frame = Image.new("RGB", (56, 56), color)
        return SimpleNamespace(
            images=[frame], text=text, text_first=self.text_first, system="Solve the maze."
        )

    def reset(self, seed: int) -> Any:
        return self._obs("Where to?", (10, 120, 10))

    def step(self, action_text: str) -> tuple[Any, float, bool, dict[str, Any]]:
        return self._obs("You moved.", (120, 10, 10)), 0.0, False, {}


@pytest.mark.parametrize("text_first", [False, True], ids=["image first", "text first"])
def test_the_agents_messages_encode_to_the_rollouts_tokens(served, text_first):
    server, url, processor = served
    env = _PromptedEnv(text_first)
    settings = RolloutSettings(
        max_turns=2, sampling=SamplingParams(temperature=0, max_tokens=1), reply_prefix="<action>"
    )
    turns = EpisodeTurns("prompted", {}, 0, settings, env_factory=lambda env_id, **_: env)
    first = turns.request
    assert first is not None
    user = next(m for m in first.messages if m["role"] == "user")
    assert [p["type"] for p in user["content"]] == (
        ["text", "image_url"] if text_first else ["image_url", "text"]
    )
    turns.answer(Reply("up", stopped=True, prompt_tokens=0, completion_tokens=2))
    request = turns.request
    assert request is not None and request.continue_final
    prompt = served_prompt(
        server, url, request.messages, extra_body={"continue_final_message": True}
    )
    # The episode as the rollouts build it: each observation's turn in its layout (the
    # system prompt opening the first), the reply prefix, the sampled reply and <|im_end|>.
    chat = ChatFormat(processor)
    ids: list[int] = []
    for k, obs in enumerate([env.reset(0), env.step("")[0]]):
        turn = chat.user_turn(
            obs.text, obs.images, first=k == 0, text_first=text_first, system=obs.system
        )
        ids += turn.token_ids + chat.encode_text("<action>")
        if k == 0:
            ids += chat.encode_text("up") + [chat.im_end_id]
    assert prompt.token_ids == ids
