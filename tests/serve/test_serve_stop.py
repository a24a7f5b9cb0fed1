"""Replies end on every eos id of the model's generation_config.json (an int or a list) and
on the tokenizer's eos, besides <|im_end|>: in the rollout engine and in `clew serve` alike,
as finish_reason "stop", with the id left out of the reply's text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.serve_cases import MODEL_ID, client, make_base, open_server, serving

from clew.data.rows import generate_rows
from clew.inference.engine import InferenceEngine
from clew.inference.runtime import open_policy
from clew.inference.sampling import SamplingParams
from clew.models.chat import ChatFormat, Chunk
from clew.rollout.loop import RolloutSettings, play

MOVES = ("up", "down", "left", "right")
QUESTION = "Which way to the goal?"
NEVER = (-1,)  # stop ids no token has: replies run to max_tokens


@pytest.fixture(scope="module")
def base(one_thread) -> Path:
    return make_base()


def with_eos(base: Path, dest: Path, eos: int | list[int]) -> Path:
    """A copy of ``base`` whose generation_config.json names ``eos`` as its eos id(s)."""
    shutil.copytree(base, dest)
    path = dest / "generation_config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = eos
    path.write_text(json.dumps(config))
    return dest


def first_new(tokens: list[int]) -> int:
    """Where a token first comes that is not among those before it (past the first, where
    any is): a stop there leaves a reply of the tokens before it."""
    return next((k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k]), 0)


def greedy(engine: InferenceEngine, prompt: Chunk, max_tokens: int = 8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, allowed_tokens=MOVES)
    return engine.open_batch(1).extend_and_generate({0: prompt}, params)[0]


def question(chat: ChatFormat) -> Chunk:
    return chat.user_turn(QUESTION, [], first=True)


def test_the_stop_ids_are_im_end_the_tokenizers_eos_and_generation_configs(base):
    policy = open_policy(base, device="cpu")
    chat, tok = policy.chat, policy.chat.tokenizer
    built = json.loads((base / "generation_config.json").read_text())["eos_token_id"]
    assert set(policy.engine.stop_token_ids) == {chat.im_end_id, tok.eos_token_id, *built}
    fresh = ChatFormat(policy.processor)
    assert fresh.stop_token_ids == (chat.im_end_id,)  # clew's tokenizer: eos is <|im_end|>
    fresh.add_stop_ids(7)
    fresh.add_stop_ids([9, None, 7])
    fresh.add_stop_ids(None)
    assert fresh.stop_token_ids == (chat.im_end_id, 7, 9)


def test_the_engine_stops_on_an_extra_generation_config_eos(base, tmp_path):
    probe = open_policy(base, device="cpu")
    prompt = question(probe.chat)
    tokens = greedy(InferenceEngine(probe.model, probe.chat, stop_token_ids=NEVER), prompt)
    tokens = tokens.token_ids
    k = first_new(tokens)
    for eos in (tokens[k], [probe.chat.im_end_id, tokens[k]]):  # an int, and a list
        policy = open_policy(with_eos(base, tmp_path / f"eos-{eos}", eos), device="cpu")
        gen = greedy(policy.engine, prompt)
        assert gen.token_ids == tokens[: k + 1] and gen.finish_reason == "stop"
        assert policy.chat.decode(gen.token_ids) == probe.chat.decode(tokens[:k])
    # The same model without it runs to max_tokens.
    assert greedy(probe.engine, prompt).finish_reason == "length"


def test_a_rollout_turn_ends_on_an_extra_generation_config_eos(base, tmp_path):
    rows = generate_rows("maze_2d/small", 1, env_options={"cell_px": 14})
    sampling = SamplingParams(temperature=0, max_tokens=6, allowed_tokens=MOVES)
    settings = RolloutSettings(
        max_turns=2, sampling=sampling, reply_prefix="<action>", reply_suffix="</action>"
    )
    probe = open_policy(base, device="cpu")
    never = InferenceEngine(probe.model, probe.chat, stop_token_ids=NEVER)
    before = play(never, rows, settings)[0]
    first_reply = [t for t, m in zip(before.token_ids, before.loss_mask, strict=True) if m][:6]
    k = first_new(first_reply)
    policy = open_policy(with_eos(base, tmp_path / "eos", [first_reply[k]]), device="cpu")
    traj = play(policy.engine, rows, settings)[0]
    sampled = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert sampled[: k + 1] == first_reply[: k + 1]
    # A reply that closed itself: the env reads the prefix and the text before the stop id,
    # no suffix, and the next turn opens as after a closed reply.
    assert traj.actions[0] == "<action>" + probe.chat.decode(first_reply[:k])
    assert before.actions[0] == "<action>" + probe.chat.decode(first_reply) + "</action>"


def test_the_server_stops_on_an_extra_generation_config_eos(base, tmp_path):
    probe = open_policy(base, device="cpu")
    prompt = question(probe.chat)
    tokens = greedy(InferenceEngine(probe.model, probe.chat, stop_token_ids=NEVER), prompt)
    k = first_new(tokens.token_ids)
    model_dir = with_eos(base, tmp_path / "eos", [probe.chat.im_end_id, tokens.token_ids[k]])
    ask = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"allowed_tokens": list(MOVES)},
    }
    expected = probe.chat.decode(tokens.token_ids[:k])
    for tokens_per_step in (1, 3):
        server = open_server(model_dir, tokens_per_step=tokens_per_step)
        with serving(server) as url:
            c = client(url)
            r = c.chat.completions.create(**ask)
            assert r.choices[0].finish_reason == "stop"
            assert r.choices[0].message.content == expected
            assert r.usage.completion_tokens == k + 1  # the stop id counts, as in vLLM
            chunks = list(c.chat.completions.create(**ask, stream=True))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
            assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_qwen3vl_checkpoints_replies_end_on_both_of_its_eos_ids(real_qwen3vl_dir):
    """Qwen3-VL-Instruct's generation_config.json lists <|im_end|> and <|endoftext|>."""
    policy = open_policy(real_qwen3vl_dir, device="cpu")
    tok = policy.chat.tokenizer
    ends = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert set(policy.engine.stop_token_ids) == ends
    assert policy.chat.decode([tok.convert_tokens_to_ids("up"), *sorted(ends)[:1]]) == "up"
