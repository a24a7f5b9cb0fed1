"""Prompt formats: clew's maze presents VisGym's and SkyRL's conversations as they do.

``data/visgym_conversations.json`` holds what VisGym's own evaluation loop and SkyRL's
VisGym env showed for scripted replies on VisGym's mazes (made by
``data/make_visgym_conversations.py`` from their code); the same replies go through clew's
maze on the same recorded mazes (``layout=visgym_easy_eval``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clew.config import load_config
from clew.envs import make
from clew.envs.maze.replies import read_reply, skyrl_extract_action, visgym_parse_output
from clew.envs.prompt_format import resolve_format
from clew.errors import ConfigError, EnvError

RECORD = json.loads(
    (Path(__file__).parents[1] / "recorded" / "visgym_conversations.json").read_text()
)
EPISODES = RECORD["episodes"]


def _play(fmt: str, episode: dict, max_turns: int = 20):
    env = make("maze_2d/easy", prompt_format=fmt, layout="visgym_easy_eval", max_turns=max_turns)
    obs = env.reset(episode["seed"])
    seen, agents = [obs], []
    for reply in episode["replies"]:
        obs, _, done, info = env.step(reply)
        agents.append(list(info["agent"]))
        if done:
            break
        seen.append(obs)
    return seen, agents


@pytest.mark.parametrize("episode", EPISODES, ids=lambda e: f"seed{e['seed']}")
def test_visgym_format_shows_what_visgyms_own_evaluation_shows(episode):
    seen, agents = _play("visgym", episode)
    want = episode["visgym"]
    assert [o.text for o in seen] == want["prompts"]
    assert agents == want["agents"]
    assert all(not o.text_first and o.system is None for o in seen)


@pytest.mark.parametrize("episode", EPISODES, ids=lambda e: f"seed{e['seed']}")
def test_skyrl_visgym_format_shows_what_the_walkthroughs_env_shows(episode):
    seen, agents = _play("skyrl-visgym", episode, max_turns=episode["skyrl_max_turns"])
    want = episode["skyrl"]
    assert [o.text for o in seen] == want["texts"]
    assert agents == want["agents"]
    assert want["content_order"] == ["text", "image_url"]
    assert all(o.text_first for o in seen)


def test_the_first_and_the_last_tuple_count_under_their_parsers():
    reply = "I will go ('move', 1), no: ('move', 2)"
    assert read_reply(reply, "skyrl", "tuple").direction == 1
    assert read_reply(reply, "visgym", "tuple").direction == 2
    assert read_reply(reply, "last", "tuple").direction == 2


def test_skyrl_fallbacks_read_fences_bare_names_and_json():
    assert skyrl_extract_action("```\n('move', 3)\n```") == "('move', 3)"
    assert skyrl_extract_action("(move, 1)") == "('move', 1)"
    assert skyrl_extract_action('{"action": "move", "args": 2}') == "('move', 2)"
    assert skyrl_extract_action("go left") is None
    assert visgym_parse_output("Action: `(move, 0)`") == "('move', 0)"


def test_a_parse_failure_reads_the_same_in_every_run():
    # ast's message names an object's address; the sentence must not.
    first = read_reply("blah", "visgym", "tuple")
    assert "0x" not in first.reason
    assert first == read_reply("blah", "visgym", "tuple")


def test_clew_format_is_the_default_and_unchanged():
    env = make("maze_2d/easy")
    obs = env.reset(3)
    assert obs.text.startswith("You are in a 9x9 maze seen from above.")
    assert not obs.text_first and obs.system is None
    obs, *_ = env.step("('move', 0)")
    assert obs.text.startswith("Turn 1: ")
    assert obs.text.endswith("19 turns remain.")


def test_a_format_overrides_fields_over_a_named_base():
    fmt = resolve_format({"name": "visgym", "system_prompt": "Be brief.", "text_first": True})
    assert fmt.name == "visgym" and fmt.system_prompt == "Be brief." and fmt.text_first
    env = make("maze_2d/easy", prompt_format={"name": "visgym", "system_prompt": "Be brief."})
    assert env.reset(0).system == "Be brief."
    env = make("maze_2d/easy", prompt_format={"feedback": {"wall": "Bump ({direction})."}})
    env.reset(0)
    texts = [env.step(f"('move', {d})")[0].text for d in range(4)]
    assert any("Bump (" in t for t in texts)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("visgim", "did you mean 'visgym'"),
        ({"sytem_prompt": "x"}, "did you mean 'system_prompt'"),
        ({"later_turn": "{feedbak}"}, "unknown field(s) {feedbak}"),
        ({"feedback": {"walls": "x"}}, "did you mean 'wall'"),
        ({"text_first": "yes"}, "text_first must be true or false"),
        ({"reply_parser": "first"}, "is not one of the maze's"),
        ({"later_turn": "{"}, "not a valid template"),
    ],
)
def test_a_bad_format_fails_naming_the_key_and_what_is_accepted(spec, message):
    with pytest.raises(EnvError) as err:
        make("maze_2d/easy", prompt_format=spec)
    assert message in str(err.value)


def test_visgyms_reading_needs_tuple_actions():
    with pytest.raises(EnvError, match="action_format"):
        make("maze_2d/easy", prompt_format="visgym", action_format="keyword")


def test_the_run_config_checks_its_format_before_any_work():
    assert load_config(None, ["environment.prompt_format=visgym"]).environment.prompt_format
    with pytest.raises(ConfigError, match="environment.prompt_format"):
        load_config(None, ["environment.prompt_format={later_turn: '{x}'}"])


def test_clew_prompt_prints_the_recipes_conversation(capsys):
    from clew.cli import main

    main(["prompt", "--config", "recipes/seed-qwen3vl-8b.yaml", "--seed", "0", "--turns", "1"])
    out = capsys.readouterr().out
    assert "prompt format skyrl-visgym" in out
    assert "You are navigating a 9x9 maze." in out
    assert "IMPORTANT: Respond with exactly one action as a Python tuple" in out
    assert "Action executed successfully.<image 225x225>" in out


def test_clew_prompt_lays_the_turns_out_in_the_models_tokens(capsys, model_dir):
    from clew.cli import main
    from clew.models import load_processor
    from clew.models.chat import ChatFormat

    args = ["prompt", "--seed", "2", "--turns", "2", "--model", str(model_dir)]
    main([*args, "environment.prompt_format=visgym", "--ids"])
    printed = json.loads(capsys.readouterr().out)
    env = make("maze_2d/easy", prompt_format="visgym")
    chat = ChatFormat(load_processor(model_dir))
    obs, ids = env.reset(2), []
    from clew.envs import expert_for

    for turn in range(2):
        ids += chat.observation_turn(obs, first=turn == 0).token_ids
        reply = expert_for("maze_2d/easy").best_actions(env)[0]
        ids += chat.reply_tokens(reply)
        obs = env.step(reply)[0]
    ids += chat.observation_turn(obs, first=False).token_ids
    assert printed["input_ids"] == ids
    assert [p["role"] for p in printed["parts"]] == ["user", "assistant"] * 2 + ["user"]
    main([*args, "environment.prompt_format=visgym"])
    out = capsys.readouterr().out
    assert "This is step 3. You are allowed to take 17 more steps." in out
    assert "image tokens" in out


def test_clew_prompt_without_a_model_refuses_ids(capsys):
    from clew.cli import main

    assert main(["prompt", "--ids"]) == 2
    assert "--ids needs a model's tokenizer" in capsys.readouterr().err


def _processor(model_dir):
    from clew.models import load_processor

    return load_processor(model_dir)


def test_a_chat_template_without_chatml_images_fails_naming_its_file(model_dir):
    from clew.errors import ModelError
    from clew.models.chat import ChatFormat

    processor = _processor(model_dir)
    processor.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    with pytest.raises(ModelError, match="does not render a user image") as err:
        ChatFormat(processor)
    assert str(model_dir) in str(err.value)


def test_a_tokenizer_without_the_vision_tokens_fails_naming_them(model_dir):
    from clew.errors import ModelError
    from clew.models.chat import ChatFormat

    processor = _processor(model_dir)
    real = processor.tokenizer.convert_tokens_to_ids

    def convert(token):
        return None if token == "<|image_pad|>" else real(token)

    processor.tokenizer.convert_tokens_to_ids = convert
    with pytest.raises(ModelError, match=r"has no token <\|image_pad\|>"):
        ChatFormat(processor)


def test_the_templates_default_system_prompt_opens_a_format_without_one(model_dir):
    from clew.models.chat import ChatFormat

    processor = _processor(model_dir)
    assert ChatFormat(processor).system_prompt is None  # clew's own template adds none
    default = (
        "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n{% for c in message['content'] %}"
        "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    processor.tokenizer.chat_template = default
    chat = ChatFormat(processor)
    assert chat.system_prompt == "You are a helpful assistant."
    obs = make("maze_2d/easy", prompt_format="visgym").reset(0)
    text = chat.tokenizer.decode(chat.observation_turn(obs, first=True).token_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    none = make("maze_2d/easy", prompt_format={"name": "visgym", "system_prompt": ""}).reset(0)
    text = chat.tokenizer.decode(chat.observation_turn(none, first=True).token_ids)
    assert text.startswith("<|im_start|>user\n")


def test_a_runs_format_replaces_the_rows_own_and_a_bad_one_fails_at_once():
    from clew.data.rows import generate_rows, with_env_option

    rows = generate_rows("maze_2d/easy", 2, "eval")
    moved = with_env_option(rows, "prompt_format", "visgym")
    env = make(moved[0].env_id, **moved[0].options())
    assert env.reset(moved[0].seed).text.startswith("You are navigating a 9x9 maze.")
    with pytest.raises(EnvError, match="unknown prompt format"):
        with_env_option(rows, "prompt_format", "visgim")


def test_visgym_frames_pass_through_a_jpeg_as_visgym_sends_them():
    import io

    import numpy as np
    from PIL import Image

    raw = make("maze_2d/easy").reset(4).images[0]
    buf = io.BytesIO()
    raw.save(buf, format="JPEG")
    jpeg = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    seen = make("maze_2d/easy", prompt_format="visgym").reset(4).images[0]
    assert np.array_equal(np.asarray(seen), jpeg)
    assert not np.array_equal(np.asarray(raw), jpeg)
    lossless = make("maze_2d/easy", prompt_format="skyrl-visgym").reset(4).images[0]
    assert np.array_equal(np.asarray(lossless), np.asarray(raw))
