"""Tests for clew.models: the task tokenizer, the offline model factory and load_policy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support.tiny import tiny_policy
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from clew.errors import CheckpointError, ClewError, ConfigError, ModelError
from clew.models import (
    PRESETS,
    BuiltModel,
    build_model,
    build_tokenizer,
    count_parameters,
    default_corpus,
    load_policy,
    load_processor,
)
from clew.models.factory import mrope_section
from clew.models.pixels import (
    Frames,
    _patch_torch,
    as_patches,
    cat_pixels,
    fast_frames,
    fast_patches,
)
from clew.models.precision import PRECISIONS, policy_precision
from clew.models.tokenizer import SPECIAL_TOKENS

USER_TURN = [
    {
        "role": "user",
        "content": [
            {"type": "image"},
            {"type": "text", "text": "You are navigating a maze. Where next?"},
        ],
    }
]


def _image(size: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> BuiltModel:
    corpus = ["The maze is 9 by 9.", "You moved right and then up."]
    return build_model("tiny", tmp_path_factory.mktemp("tiny") / "model", corpus, seed=0)


@pytest.fixture(scope="module")
def tiny_inputs(tiny: BuiltModel):
    text = tiny.processor.apply_chat_template(USER_TURN, add_generation_prompt=True)
    return tiny.processor(text=[text], images=[_image(252)], return_tensors="pt")


@pytest.mark.parametrize(
    "text",
    [
        "You are navigating a maze.",
        "line one\nline two\n\n\tindented\r\nend\n",
        "unicode: naïve café, 迷路, Ωμέγα, emoji 🧭🙂",
        "never seen: xylophone quizzical 1234567890 ~!@#$%^&*()_+{}|:<>?",
        "  leading and trailing spaces  ",
        "<action>up</action> ('move', 0) ('stop', 'stop')",
        "",
    ],
)
def test_tokenizer_round_trips_arbitrary_text(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None


def test_special_tokens_are_single_ids(tokenizer) -> None:
    for token in SPECIAL_TOKENS:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert ids == [tokenizer.convert_tokens_to_ids(token)], token
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token == "<|endoftext|>"
    assert len(set(tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)))) == len(SPECIAL_TOKENS)


def test_tokenizer_adds_no_tokens_of_its_own(tokenizer) -> None:
    assert tokenizer("up")["input_ids"] == tokenizer("up", add_special_tokens=False)["input_ids"]


def test_action_replies_are_tag_word_tag(tokenizer) -> None:
    # One decision token per reply: the tags are whole tokens, never merged into the word.
    for word in ("right", "up", "left", "down", "stop"):
        ids = tokenizer(f"<action>{word}</action>", add_special_tokens=False)["input_ids"]
        pieces = [tokenizer.decode([i]) for i in ids]
        assert pieces == ["<action>", word, "</action>"], pieces
    reply = "<action>up</action><|im_end|>"
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<action>up</action>"


def test_tokenizer_training_is_deterministic() -> None:
    corpus = [f"You moved {word} {n} times." for word in ("up", "left") for n in range(30)]
    first = build_tokenizer(corpus, vocab_size=400)
    second = build_tokenizer(corpus, vocab_size=400)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


def test_tokenizer_vocab_is_capped_by_target_size() -> None:
    corpus = [f"word{n} other{n * 7} thing{n % 13}" for n in range(500)]
    assert len(build_tokenizer(corpus, vocab_size=300)) <= 300
    assert len(build_tokenizer(corpus, vocab_size=600)) > 300


def test_tokenizer_rejects_too_small_vocab() -> None:
    with pytest.raises(ValueError, match="at least"):
        build_tokenizer(vocab_size=100)


def test_default_corpus_makes_task_words_short(tokenizer) -> None:
    assert "<action>up</action>" in default_corpus()
    for word in ("right", " up", " left", " down", " stop", " maze", " wall"):
        assert len(tokenizer(word)["input_ids"]) == 1, word


def test_chat_template_renders_images_and_generation_prompt(tokenizer) -> None:
    messages = [
        *USER_TURN,
        {"role": "assistant", "content": "<action>up</action>"},
        {"role": "user", "content": [{"type": "text", "text": "Moved."}, {"type": "image"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "You are navigating a maze. Where next?<|im_end|>\n"
        "<|im_start|>assistant\n<action>up</action><|im_end|>\n"
        "<|im_start|>user\nMoved.<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not without.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("size", "tokens"), [(252, 81), (140, 25), (28, 1)])
def test_images_keep_one_vision_token_per_28_pixels(
    tiny: BuiltModel, size: int, tokens: int
) -> None:
    text = tiny.processor.apply_chat_template(USER_TURN, add_generation_prompt=True)
    inputs = tiny.processor(text=[text], images=[_image(size)], return_tensors="pt")
    image_id = tiny.model.config.image_token_id
    assert int((inputs["input_ids"] == image_id).sum()) == tokens
    assert inputs["image_grid_thw"].tolist() == [[1, size // 14, size // 14]]


def test_saved_model_reloads_with_identical_logits(tiny: BuiltModel, tiny_inputs) -> None:
    model, processor = load_policy(tiny.path, dtype="float32", device="cpu")
    # PIL everywhere, also where torchvision is installed: same pixels on every machine.
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    text = processor.apply_chat_template(USER_TURN, add_generation_prompt=True)
    inputs = processor(text=[text], images=[_image(252)], return_tensors="pt")
    assert torch.equal(inputs["input_ids"], tiny_inputs["input_ids"])
    assert torch.equal(inputs["pixel_values"], tiny_inputs["pixel_values"])
    with torch.no_grad():
        expected = tiny.model(**tiny_inputs).logits
        actual = model(**inputs).logits
    assert torch.equal(actual, expected)
    assert not model.training


def test_load_policy_casts_to_requested_dtype(tiny: BuiltModel) -> None:
    model, _ = load_policy(tiny.path, dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_transformers_auto_classes_read_the_directory(tiny: BuiltModel, tiny_inputs) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny.path, local_files_only=True)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    tokenizer = AutoTokenizer.from_pretrained(tiny.path, local_files_only=True)
    assert tokenizer.get_vocab() == tiny.processor.tokenizer.get_vocab()
    processor = AutoProcessor.from_pretrained(tiny.path, local_files_only=True)
    text = processor.apply_chat_template(USER_TURN, add_generation_prompt=True)
    inputs = processor(text=[text], images=[_image(252)], return_tensors="pt")
    assert torch.equal(inputs["input_ids"], tiny_inputs["input_ids"])


def test_generate_with_an_image(tiny: BuiltModel, tiny_inputs) -> None:
    with torch.no_grad():
        output = tiny.model.generate(**tiny_inputs, max_new_tokens=4, do_sample=False)
    prompt_length = tiny_inputs["input_ids"].shape[1]
    assert output.shape[0] == 1
    assert prompt_length < output.shape[1] <= prompt_length + 4
    assert isinstance(tiny.processor.batch_decode(output[:, prompt_length:])[0], str)


def test_forward_and_backward_on_a_padded_batch(tiny: BuiltModel) -> None:
    processor = tiny.processor
    short = processor.apply_chat_template(USER_TURN, add_generation_prompt=True)
    long = short + "Think first. " * 5
    inputs = processor(
        text=[short, long], images=[_image(140), _image(252)], padding=True, return_tensors="pt"
    )
    output = tiny.model(**inputs, labels=inputs["input_ids"])
    output.loss.backward()
    assert torch.isfinite(output.loss)
    tiny.model.zero_grad(set_to_none=True)


def test_tiny_parameter_count_in_documented_range(tiny: BuiltModel) -> None:
    assert tiny.num_parameters == count_parameters(tiny.model)
    assert 1_000_000 <= tiny.num_parameters <= 3_000_000
    info = json.loads((tiny.path / "clew_build.json").read_text())
    assert info["num_parameters"] == tiny.num_parameters


def test_config_wires_tokenizer_ids_and_sizes(tiny: BuiltModel) -> None:
    config = tiny.model.config
    tokenizer = tiny.processor.tokenizer
    assert config.text_config.vocab_size == len(tokenizer)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert config.vision_end_token_id == tokenizer.convert_tokens_to_ids("<|vision_end|>")
    assert config.vision_config.hidden_size == config.text_config.hidden_size
    assert tiny.model.generation_config.eos_token_id[0] == tokenizer.eos_token_id
    assert tiny.model.generation_config.pad_token_id == tokenizer.pad_token_id


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_mrope_section_sums_to_half_head_dim(head_dim: int) -> None:
    assert sum(mrope_section(head_dim)) == head_dim // 2
    assert mrope_section(128) == [16, 24, 24]


def test_same_seed_builds_same_weights(tmp_path: Path) -> None:
    first = build_model("tiny", tmp_path / "a", seed=3)
    second = build_model("tiny", tmp_path / "b", seed=3)
    other = build_model("tiny", tmp_path / "c", seed=4)
    first_state, second_state = first.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(first_state[k], second_state[k]) for k in first_state)
    assert not torch.equal(
        first_state["lm_head.weight"], other.model.state_dict()["lm_head.weight"]
    )


def test_merge_size_one_gives_one_token_per_patch() -> None:
    model, processor = load_policy(tiny_policy(patch_size=20, merge_size=1, image_size=140))
    text = processor.apply_chat_template(USER_TURN, add_generation_prompt=True)
    inputs = processor(text=[text], images=[_image(140)], return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 49
    with torch.no_grad():
        assert model(**inputs).logits.shape[1] == inputs["input_ids"].shape[1]


def test_build_model_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tiny, small, deep, medium, base"):
        build_model("huge", tmp_path / "x")
    with pytest.raises(ConfigError, match="multiple of patch_size"):
        build_model("tiny", tmp_path / "x", image_size=225)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        build_model("tiny", tmp_path / "full")


def test_presets_are_documented_sizes() -> None:
    assert set(PRESETS) == {"tiny", "small", "deep", "medium", "base", "qwen3vl-8b"}
    assert PRESETS["small"].hidden_size == 256 and PRESETS["small"].num_hidden_layers == 6


def test_load_policy_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_policy(tmp_path / "nowhere")


def test_load_policy_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_policy(tmp_path)


def test_load_policy_rejects_non_vl_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelError, match="'bert'") as raised:
        load_policy(tmp_path)
    for accepted in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        assert accepted in str(raised.value)


def test_load_policy_missing_tokenizer_files(tiny: BuiltModel, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny.path, broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer files") as raised:
        load_policy(broken)
    assert "tokenizer.json" in str(raised.value)


def test_load_policy_missing_weights(tiny: BuiltModel, tmp_path: Path) -> None:
    broken = tmp_path / "noweights"
    shutil.copytree(tiny.path, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_policy(broken)


def test_load_policy_rejects_unknown_dtype_and_device(tiny: BuiltModel) -> None:
    with pytest.raises(ConfigError, match="bfloat16"):
        load_policy(tiny.path, dtype="float8")
    with pytest.raises(ConfigError, match="device"):
        load_policy(tiny.path, device="tpu-ish")


def test_load_policy_falls_back_when_auto_processor_needs_video(
    tiny: BuiltModel, tiny_inputs, tmp_path: Path
) -> None:
    # A real Qwen2-VL directory names Qwen2VLProcessor, whose video processor needs
    # torchvision or a video config; load_policy must still give a working image processor.
    qwen_like = tmp_path / "qwen_like"
    shutil.copytree(tiny.path, qwen_like)
    config_file = qwen_like / "processor_config.json"
    processor_config = json.loads(config_file.read_text())
    processor_config["processor_class"] = "Qwen2VLProcessor"
    config_file.write_text(json.dumps(processor_config))
    _, processor = load_policy(qwen_like)
    text = processor.apply_chat_template(USER_TURN, add_generation_prompt=True)
    inputs = processor(text=[text], images=[_image(252)], return_tensors="pt")
    assert torch.equal(inputs["input_ids"], tiny_inputs["input_ids"])


def test_errors_are_clew_errors() -> None:
    assert issubclass(CheckpointError, ClewError)
    assert issubclass(ModelError, ClewError)


@pytest.mark.parametrize(("merge", "size"), [(2, 252), (1, 140)])
def test_fast_patches_equal_the_image_processor_bit_for_bit(merge: int, size: int) -> None:
    patch = 14 if merge == 2 else 20
    policy = tiny_policy(patch_size=patch, merge_size=merge, image_size=size)
    ip = load_processor(policy).image_processor
    images = [_image(size, seed) for seed in range(5)]
    pixels, grid = fast_patches(images, ip)
    ref = ip(images=images, return_tensors="pt")
    assert torch.equal(pixels, ref["pixel_values"])
    assert torch.equal(grid, ref["image_grid_thw"])


def test_frames_patched_later_equal_the_processor_and_stay_bytes_when_joined(
    tiny: BuiltModel,
) -> None:
    ip = tiny.processor.image_processor
    a, b = [_image(252, 1), _image(252, 2)], [_image(252, 3)]
    fa, fb = fast_frames(a, ip), fast_frames(b, ip)
    assert isinstance(fa, Frames) and isinstance(fb, Frames)
    assert fa.data.dtype == torch.uint8 and len(fa) == 2
    joined = cat_pixels([fa, fb])
    assert isinstance(joined, Frames) and len(joined) == 3
    ref = ip(images=a + b, return_tensors="pt")["pixel_values"]
    assert torch.equal(as_patches(joined), ref)
    # Frames beside patches (an image the fast path did not cover) join as patches.
    mixed = cat_pixels([fa, ip(images=b, return_tensors="pt")["pixel_values"]])
    assert not isinstance(mixed, Frames) and torch.equal(mixed, ref)
    # The accelerator path (torch, run here on CPU tensors) gives the same values.
    shape = (joined.patch, joined.merge, joined.temporal)
    assert torch.equal(_patch_torch(joined.data, joined.table, *shape), ref)


def test_fast_patches_leave_mixed_sizes_and_modes_to_the_processor(tiny: BuiltModel) -> None:
    ip = tiny.processor.image_processor
    assert fast_patches([_image(252), _image(224)], ip) is None  # mixed sizes
    assert fast_patches([_image(252).convert("CMYK")], ip) is None  # a mode it does not convert
    assert fast_patches([], ip) is None


@pytest.mark.parametrize(("patch", "size"), [(16, 252), (14, 250), (16, 90)])
def test_fast_patches_resize_as_the_processor_does_bit_for_bit(patch: int, size: int) -> None:
    # Qwen3-VL's patch 16 x merge 2 does not divide maze_2d/easy's 252 px frames: the
    # processor resizes them to 256 px (and 90 px frames up to 96).
    ip = load_processor(tiny_policy(arch="qwen3_vl", patch_size=patch)).image_processor
    images = [_image(size, seed) for seed in range(3)]
    covered = fast_patches(images, ip)
    assert covered is not None
    ref = ip(images=images, return_tensors="pt")
    assert torch.equal(covered[0], ref["pixel_values"])
    assert torch.equal(covered[1], ref["image_grid_thw"])
    assert int(covered[1][0, 1]) * patch != size  # a resize really happened
    frames = fast_frames(images, ip)
    assert torch.equal(as_patches(frames), ref["pixel_values"])


class _OtherResize:
    """An image processor whose resize Pillow's does not reproduce."""

    def __init__(self, ip) -> None:
        self.ip = ip

    def __getattr__(self, name: str):
        return getattr(self.ip, name)

    def __call__(self, **kwargs):
        out = self.ip(**kwargs)
        out["pixel_values"] = out["pixel_values"] + 1e-3
        return out


def test_a_processor_that_resizes_another_way_keeps_its_resized_frames(tiny: BuiltModel) -> None:
    ip = _OtherResize(tiny.processor.image_processor)
    assert fast_patches([_image(250)], ip) is None  # resized: left to the processor
    assert fast_patches([_image(252)], ip) is not None  # kept as it is: covered


def test_policy_precision_keeps_trained_weights_in_float32() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert policy_precision(cuda, "bf16-mixed", lora=False) == ("float32", True)
    assert policy_precision(cuda, "bf16-mixed", lora=True) == ("bfloat16", True)  # frozen base
    assert policy_precision(cuda, "bf16-true", lora=False) == ("bfloat16", True)
    assert policy_precision(cuda, "32-true", lora=True) == ("float32", False)
    for precision in PRECISIONS:
        assert policy_precision(cpu, precision, lora=False) == ("float32", False)
    with pytest.raises(ConfigError, match="bf16-mixed, bf16-true, 32-true.*got 'bf16'"):
        policy_precision(cuda, "bf16", lora=False)
