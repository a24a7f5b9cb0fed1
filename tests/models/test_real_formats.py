"""VisGym's conversations, token for token, under the real Qwen3-VL chat template.

The checkpoint of ``real_qwen3vl_dir`` has the genuine Qwen tokenizer and
Qwen3-VL-8B-Instruct's template. An episode played through clew's ``visgym`` and
``skyrl-visgym`` formats must tokenize exactly as the messages VisGym (image, then text)
and SkyRL (text, then image) send, rendered by that template; and ``clew serve`` must encode
those messages to the same ids.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
from support.serve_cases import open_server, served_prompt, serving

from clew.envs import expert_for, make
from clew.models import load_processor
from clew.models.chat import ChatFormat, Chunk, join_chunks

FORMATS = ("visgym", "skyrl-visgym")


def _episode(fmt: str, seed: int, turns: int) -> tuple[list, list[str]]:
    """The observations and expert replies of ``turns`` turns (the last observation
    unanswered), on VisGym's own maze ``seed``."""
    env = make("maze_2d/easy", prompt_format=fmt, layout="visgym_easy_eval")
    obs = env.reset(seed)
    seen, replies = [obs], []
    for _ in range(turns - 1):
        reply = expert_for("maze_2d/easy").best_actions(env)[0]
        replies.append(reply)
        obs = env.step(reply)[0]
        seen.append(obs)
    return seen, replies


def _url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(seen: list, replies: list[str]) -> list[dict[str, Any]]:
    """The messages VisGym (image first) or SkyRL (text first) send for the episode."""
    messages: list[dict[str, Any]] = []
    for turn, obs in enumerate(seen):
        text = [{"type": "text", "text": obs.text}]
        image = [{"type": "image_url", "image_url": {"url": _url(im)}} for im in obs.images]
        messages.append(
            {"role": "user", "content": text + image if obs.text_first else image + text}
        )
        if turn < len(replies):
            messages.append({"role": "assistant", "content": replies[turn]})
    return messages


def _ours(chat: ChatFormat, seen: list, replies: list[str]) -> Chunk:
    chunks = []
    for turn, obs in enumerate(seen):
        chunks.append(chat.observation_turn(obs, first=turn == 0))
        if turn < len(replies):
            chunks.append(Chunk(chat.reply_tokens(replies[turn])))
    return join_chunks(chunks)


@pytest.fixture(scope="module")
def processor(real_qwen3vl_dir):
    return load_processor(real_qwen3vl_dir)


@pytest.mark.parametrize("turns", [1, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_formats_episode_tokenizes_as_the_real_template_renders_its_messages(
    processor, fmt, turns
):
    seen, replies = _episode(fmt, seed=3, turns=turns)
    ours = _ours(ChatFormat(processor), seen, replies)
    messages = _messages(seen, replies)
    rendered = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert not rendered.startswith("<|im_start|>system")  # Qwen3-VL adds no default
    frames = [im for obs in seen for im in obs.images]
    theirs = processor(text=[rendered], images=frames, return_tensors="pt")
    assert ours.token_ids == theirs["input_ids"][0].tolist()
    assert ours.image_grid_thw.tolist() == theirs["image_grid_thw"].tolist()


@pytest.fixture(scope="module")
def served(real_qwen3vl_dir):
    server = open_server(Path(real_qwen3vl_dir))
    with serving(server) as url:
        yield server, url


@pytest.mark.parametrize("fmt", FORMATS)
def test_clew_serve_encodes_a_formats_messages_to_the_rollouts_ids(processor, served, fmt):
    server, url = served
    seen, replies = _episode(fmt, seed=5, turns=3)
    prompt = served_prompt(server, url, _messages(seen, replies))
    assert prompt.token_ids == _ours(ChatFormat(processor), seen, replies).token_ids
