"""The qwen3vl-8b preset, built narrow on the CPU: its config, counts, on-device init and vocabulary."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

import clew.models.presets
from clew.errors import ConfigError
from clew.models import PRESETS, build_model, build_tokenizer, load_policy
from clew.models.factory import QWEN_VOCAB_SIZE, preset_config, preset_parameters
from clew.models.sizes import config_parameters
from clew.models.vocab import pad_vocabulary

# The 8B's structure (36 text layers, 27 vision blocks, taps at 8/16/24, 4 query heads per
# KV head, the 2304-entry position table) at widths a CPU builds in a second.
NARROW_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
}
NARROW_VISION = {"hidden_size": 32, "intermediate_size": 120, "num_heads": 2}


def _narrow(path, **kwargs):
    return build_model(
        "qwen3vl-8b", path, text_overrides=NARROW_TEXT, vision_overrides=NARROW_VISION, **kwargs
    )


def test_the_8b_preset_has_qwen3_vl_8b_instructs_published_sizes() -> None:
    config = preset_config("qwen3vl-8b", vocab_size=QWEN_VOCAB_SIZE)
    text, vision = config.text_config, config.vision_config
    assert config.model_type == "qwen3_vl" and not config.tie_word_embeddings
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size) == (4096, 36, 12288)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (32, 8, 128)
    assert text.vocab_size == 151_936 and text.max_position_embeddings == 262_144
    assert text.rms_norm_eps == 1e-6 and not text.attention_bias
    rope = text.rope_parameters
    assert rope["rope_theta"] == 5_000_000 and rope["mrope_section"] == [24, 20, 20]
    assert rope["mrope_interleaved"]
    assert (vision.depth, vision.hidden_size, vision.intermediate_size) == (27, 1152, 4304)
    assert (vision.num_heads, vision.patch_size, vision.spatial_merge_size) == (16, 16, 2)
    assert vision.temporal_patch_size == 2 and vision.num_position_embeddings == 2304
    assert list(vision.deepstack_visual_indexes) == [8, 16, 24]
    assert vision.hidden_act == "gelu_pytorch_tanh" and vision.out_hidden_size == 4096


def test_the_8b_count_from_the_config_is_the_real_models_and_a_meta_builds() -> None:
    config = preset_config("qwen3vl-8b", vocab_size=QWEN_VOCAB_SIZE)
    assert config_parameters(config) == 8_767_123_696  # Qwen3-VL-8B-Instruct's 8.77B
    with torch.device("meta"):  # shapes only: nothing allocated
        model = Qwen3VLForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 8_767_123_696


def _table() -> dict[str, tuple[str, str]]:
    rows = re.findall(
        r"^    ([a-z0-9-]+) .*?\)\s+([\d,]+|-)\s+([\d,]+)$", clew.models.presets.__doc__, re.M
    )
    return {name: (qwen2, qwen3) for name, qwen2, qwen3 in rows}


def test_the_preset_table_prints_the_counts_of_the_configs() -> None:
    table = _table()
    assert set(table) == set(PRESETS)
    for name, (qwen2, qwen3) in table.items():
        assert int(qwen3.replace(",", "")) == preset_parameters(name, "qwen3_vl"), name
        if PRESETS[name].arch is None:
            assert int(qwen2.replace(",", "")) == preset_parameters(name, "qwen2_vl"), name
    vision = config_parameters(preset_config("qwen3vl-8b", vocab_size=QWEN_VOCAB_SIZE))
    assert f"{vision:,}" in clew.models.presets.__doc__


def test_approximate_counts_round_the_tables() -> None:
    for name, spec in PRESETS.items():
        count = preset_parameters(name)
        value, unit = float(spec.approx_parameters[:-1]), spec.approx_parameters[-1]
        scale = {"M": 1e6, "B": 1e9}[unit]
        digits = len(spec.approx_parameters[:-1].partition(".")[2])
        assert round(count / scale, digits) == value, (name, count)


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_vl"])
def test_the_count_arithmetic_equals_built_models(tmp_path, arch) -> None:
    built = build_model("tiny", tmp_path / arch, arch=arch)
    assert config_parameters(built.model.config) == built.num_parameters
    narrow = _narrow(tmp_path / "narrow")
    assert config_parameters(narrow.model.config) == narrow.num_parameters


def test_a_narrow_8b_keeps_the_8b_structure_and_defaults_to_qwen3_vl(tmp_path) -> None:
    built = _narrow(tmp_path / "m")
    assert isinstance(built.model, Qwen3VLForConditionalGeneration)
    config = built.model.config
    assert config.text_config.num_hidden_layers == 36 and config.vision_config.depth == 27
    assert list(config.vision_config.deepstack_visual_indexes) == [8, 16, 24]
    assert config.vision_config.num_position_embeddings == 2304
    # image_size caps the processor only: the preset keeps the real model's position table.
    sized = _narrow(tmp_path / "sized", image_size=256)
    assert sized.model.config.vision_config.num_position_embeddings == 2304
    with pytest.raises(ConfigError, match="qwen3_vl's architecture"):
        _narrow(tmp_path / "q2", arch="qwen2_vl")


def test_a_model_made_on_the_device_is_initialised_as_the_host_build_is(tmp_path) -> None:
    host = _narrow(tmp_path / "host")
    made = _narrow(tmp_path / "made", device="cpu")
    assert json.loads((made.path / "clew_build.json").read_text())["device"] == "cpu"
    host_params, made_params = (
        dict(host.model.named_parameters()),
        dict(made.model.named_parameters()),
    )
    assert host_params.keys() == made_params.keys()
    for name, p in host_params.items():
        q = made_params[name]
        assert q.shape == p.shape, name
        # Same distributions (normal 0.02, ones, zeros, the sin-cos table), other draws.
        assert abs(p.mean() - q.mean()) < 0.01 and abs(p.std() - q.std()) < 0.005, name
    assert torch.equal(
        host_params["model.visual.pos_embed.weight"], made_params["model.visual.pos_embed.weight"]
    )
    # to_empty leaves buffers as garbage: the rotary frequencies must be computed again.
    host_buffers = dict(host.model.named_buffers())
    for name, b in made.model.named_buffers():
        assert b.dtype == torch.float32 and torch.equal(b, host_buffers[name]), name
    again = _narrow(tmp_path / "again", device="cpu")
    assert all(
        torch.equal(a, b)
        for a, b in zip(made.model.parameters(), again.model.parameters(), strict=True)
    )


def test_a_bfloat16_model_made_on_the_device_loads_back_and_runs(tmp_path) -> None:
    made = _narrow(tmp_path / "m", device="cpu", dtype="bfloat16")
    assert {p.dtype for p in made.model.parameters()} == {torch.bfloat16}
    model, processor = load_policy(made.path, dtype="bfloat16")
    ids = processor.tokenizer("You moved up.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = made.model(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, expected)
    assert torch.isfinite(expected).all()


def test_a_padded_vocabulary_encodes_as_the_task_tokenizer_and_decodes_its_own_entries() -> None:
    small = build_tokenizer()
    padded = pad_vocabulary(small, QWEN_VOCAB_SIZE)
    assert len(padded) == QWEN_VOCAB_SIZE
    text = "<|im_start|>user\nYou moved up. <action>left</action> ☃ <|unused_9000|><|im_end|>"
    assert padded(text)["input_ids"] == small(text)["input_ids"]
    assert padded.decode(padded(text)["input_ids"]) == text
    assert padded.convert_ids_to_tokens([402, 403, 404, 151_935]) == [
        "<action>",
        "</action>",
        "<|unused_404|>",
        "<|unused_151935|>",
    ]
    assert padded.chat_template == small.chat_template and padded.padding_side == "left"
    with pytest.raises(ConfigError, match="at least 404"):
        pad_vocabulary(small, 300)


def test_init_model_builds_the_8b_with_a_full_vocabulary_in_one_command(tmp_path, capsys) -> None:
    from clew.cli import main

    out = tmp_path / "8b"
    narrow = [f"--text={k}={v}" for k, v in NARROW_TEXT.items()]
    narrow += [f"--vision={k}={v}" for k, v in NARROW_VISION.items()]
    args = ["init-model", "--preset", "qwen3vl-8b", "--device", "cpu", "--vocab-size", "151936"]
    assert main([*args, *narrow, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "151,936 vocabulary entries" in printed and "weights made on cpu" in printed
    info = json.loads((out / "clew_build.json").read_text())
    assert info["arch"] == "qwen3_vl" and info["vocab_size"] == 151_936 and info["padded_vocab"]
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == 151_936
    model, processor = load_policy(out)
    assert len(processor.tokenizer) == model.get_output_embeddings().weight.shape[0] == 151_936


def test_a_device_this_machine_lacks_is_refused_before_anything_is_written(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="no CUDA device"):
        _narrow(tmp_path / "m", device="cuda")
    assert not (tmp_path / "m").exists()
