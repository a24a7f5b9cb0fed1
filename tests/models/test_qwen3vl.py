"""A tiny Qwen3-VL policy built offline: save/load, M-RoPE positions, KV-reused rollout logprobs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3VLForConditionalGeneration

from clew.data.rows import generate_rows
from clew.errors import ConfigError
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat, Chunk, join_chunks
from clew.models.pixels import as_patches
from clew.models.positions import sequence_positions
from clew.models.qwen3 import qwen3_mrope_section, sincos_position_table
from clew.rollout.loop import RolloutSettings, play

# maze_2d/small at 16 px cells is a 112 px image: 8 x 8 patches of 14 px, 4 x 4 merged tokens.
OPTIONS = {"cell_px": 16, "action_format": "keyword"}


def _image(size: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3") / "tiny"
    return build_model("tiny", path, arch="qwen3_vl", image_size=112, patch_size=14)


@pytest.fixture(scope="module")
def policy(built):
    model, processor = load_policy(built.path)
    return model, ChatFormat(processor)


def _two_image_sequence(chat: ChatFormat):
    first = chat.user_turn("Where next?", [_image(112, 0)], first=True)
    second = chat.user_turn("You moved up.", [_image(112, 1)], first=False)
    return join_chunks([first, Chunk(chat.reply_tokens("up")), second])


def test_build_writes_a_qwen3_vl_directory(built) -> None:
    config = json.loads((built.path / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl"
    vision, text = config["vision_config"], config["text_config"]
    assert vision["patch_size"] == 14 and vision["out_hidden_size"] == text["hidden_size"] == 128
    assert vision["num_position_embeddings"] == 64  # (112 / 14) ** 2: one per patch
    assert vision["deepstack_visual_indexes"] == [0]
    assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] // 2 == 16
    assert json.loads((built.path / "clew_build.json").read_text())["arch"] == "qwen3_vl"
    assert isinstance(built.model, Qwen3VLForConditionalGeneration)
    assert built.model.model.visual.pos_embed.weight.shape == (64, 128)
    assert 1_000_000 < built.num_parameters < 3_000_000


def test_load_policy_round_trip_gives_identical_logits(built, policy) -> None:
    model, chat = policy
    chunk = chat.user_turn("Where next?", [_image(112)], first=True)
    assert chunk.token_ids.count(chat.image_token_id) == 16
    ids = torch.tensor([chunk.token_ids])
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": as_patches(chunk.pixel_values),
        "image_grid_thw": chunk.image_grid_thw,
        "mm_token_type_ids": (ids == chat.image_token_id).int(),
    }
    with torch.no_grad():
        ours = built.model(**inputs).logits
        theirs = model(**inputs).logits
    assert torch.equal(ours, theirs)


def test_positions_equal_qwen3_rope_index_with_two_images(policy) -> None:
    model, chat = policy
    seq = _two_image_sequence(chat)
    assert seq.num_images == 2
    ids = torch.tensor([seq.token_ids])
    theirs, _ = model.model.get_rope_index(
        ids,
        mm_token_type_ids=(ids == chat.image_token_id).int(),
        image_grid_thw=seq.image_grid_thw,
        attention_mask=torch.ones_like(ids),
    )
    ours = sequence_positions(
        seq.token_ids, seq.image_grid_thw, chat.image_token_id, chat.merge_size
    )
    assert torch.equal(ours, theirs[:, 0])


def test_kv_reused_logprobs_match_a_full_recompute(policy) -> None:
    model, chat = policy
    rows = generate_rows("maze_2d/small", 2, env_options=OPTIONS)
    settings = RolloutSettings(
        n_samples_per_prompt=2,
        max_turns=3,
        max_input_length=4096,
        sampling=SamplingParams(temperature=1.0, max_tokens=6),
    )
    trajs = play(InferenceEngine(model, chat), rows, settings, seed=3)
    banned = InferenceEngine(model, chat).banned_token_ids
    worst = 0.0
    for t in trajs:
        assert t.turns >= 2  # a later turn appends an image chunk to a filled cache
        ids = torch.tensor([t.token_ids])
        pixel_values, grid = t.vision_inputs(chat)
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pixel_values=pixel_values,
                image_grid_thw=grid,
                mm_token_type_ids=(ids == chat.image_token_id).int(),
            ).logits[0, :-1]
        logits[:, banned] = float("-inf")
        full = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        worst = max(worst, float((full[mask] - torch.tensor(t.logprobs[1:])[mask]).abs().max()))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


def test_qwen3_mrope_section_follows_qwen3_vl() -> None:
    assert qwen3_mrope_section(128) == [24, 20, 20]
    for head_dim in (16, 32, 64, 96):
        t, h, w = qwen3_mrope_section(head_dim)
        assert t + h + w == head_dim // 2 and 3 * max(h, w) <= head_dim // 2


def test_bad_qwen3_settings_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="arch"):
        build_model("tiny", tmp_path / "a", arch="llava")
    with pytest.raises(ConfigError, match="multiple of patch_size"):
        build_model("tiny", tmp_path / "b", arch="qwen3_vl", image_size=112)  # patch 16: 32 px
    with pytest.raises(ConfigError, match="square"):
        build_model(
            "tiny",
            tmp_path / "c",
            arch="qwen3_vl",
            vision_overrides={"num_position_embeddings": 50},
        )
    with pytest.raises(ConfigError, match="deepstack"):
        build_model(
            "tiny",
            tmp_path / "d",
            arch="qwen3_vl",
            vision_overrides={"deepstack_visual_indexes": [1]},
        )


def test_trainer_logprobs_match_the_engine_with_old_images_hidden(policy) -> None:
    from clew.train.worker import PolicyWorker

    model, chat = policy
    rows = generate_rows("maze_2d/small", 2, env_options=OPTIONS)
    settings = RolloutSettings(
        n_samples_per_prompt=2,
        max_turns=4,
        max_input_length=4096,
        sampling=SamplingParams(temperature=1.0, max_tokens=6),
        keep_last_k_images=1,
    )
    trajs = play(InferenceEngine(model, chat), rows, settings, seed=5)
    recomputed = PolicyWorker(model, chat).compute_logprobs(trajs, 1.0, 4)
    model.eval()
    worst = 0.0
    for t, lp in zip(trajs, recomputed, strict=True):
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        worst = max(worst, float((lp[mask] - torch.tensor(t.logprobs[1:])[mask]).abs().max()))
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"


def test_position_table_starts_as_a_2d_sincos_grid(built) -> None:

    model = Qwen3VLForConditionalGeneration.from_pretrained(built.path)
    table = model.model.visual.pos_embed.weight.detach()
    side = round(table.shape[0] ** 0.5)
    assert torch.allclose(table, sincos_position_table(side, table.shape[1]))
    # Row and column halves: cells in one row share the row half and differ in the other.
    half = table.shape[1] // 2
    assert torch.equal(table[0, :half], table[1, :half])
    assert not torch.equal(table[0, half:], table[1, half:])
    assert not torch.equal(table[0, :half], table[side, :half])


def test_a_user_turn_without_pixels_has_the_same_tokens_and_grids(policy) -> None:
    _, chat = policy
    images = [_image(112, 0), _image(112, 1)]
    full = chat.user_turn("You moved up.", images, first=False)
    lean = chat.user_turn("You moved up.", images, first=False, pixels=False)
    assert lean.token_ids == full.token_ids
    assert torch.equal(lean.image_grid_thw, full.image_grid_thw)
    assert full.pixel_values is not None and lean.pixel_values is None
    # Repeated text comes from the tokenization cache, unchanged and not aliased.
    again = chat.user_turn("You moved up.", images, first=False, pixels=False)
    again.token_ids.append(-1)
    assert chat.user_turn("You moved up.", images, first=False).token_ids == full.token_ids


def test_init_model_replaces_preset_fields_from_the_command_line(tmp_path) -> None:
    from clew.cli import main

    out = tmp_path / "v"
    code = main(
        [
            "init-model", "--preset", "tiny", "--arch", "qwen3_vl", "--image-size", "70",
            "--patch-size", "14", "--merge-size", "1", "--output", str(out),
            "--vision", "depth=3", "--vision", "deepstack_visual_indexes=[0,2]",
            "--text", "num_hidden_layers=4",
        ]
    )  # fmt: skip
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["depth"] == 3
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 2]
    assert config["text_config"]["num_hidden_layers"] == 4


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--vision", "dept=3", "did you mean 'depth'"),
        ("--text", "num_hidden_layers", "takes KEY=VALUE"),
        ("--vision", "deepstack_visual_indexes=[0,5]", "must be distinct vision layers"),
    ],
)
def test_init_model_refuses_unknown_or_inconsistent_fields(tmp_path, capsys, flag, value, message):
    from clew.cli import main

    out = tmp_path / "v"
    args = ["init-model", "--preset", "tiny", "--arch", "qwen3_vl", "--output", str(out)]
    assert main([*args, flag, value]) != 0
    assert message in capsys.readouterr().err
    assert not (out / "config.json").exists()


def _image_embedding_shares(path, border: int) -> tuple[float, float]:
    """(shared-vector share, frame-varying share) of the image embeddings' energy over 16
    maze frames (one agent cell each)."""
    from clew.envs.maze.generate import generate_maze
    from clew.envs.maze.render import render_background, stamp_agent

    model, processor = load_policy(path)
    chat = ChatFormat(processor)
    frames = []
    for seed in range(16):
        maze = generate_maze(7, seed)
        background = render_background(maze, 14, border)
        frames.append(Image.fromarray(stamp_agent(background, maze.start, 14, border)))
    pixel_values, grid = chat.encode_images(frames)
    with torch.no_grad():
        out = model.model.visual(pixel_values, grid_thw=grid)
    embeds = (out[0] if isinstance(out, tuple) else out.pooler_output).float()
    x = embeds.reshape(len(frames), -1, embeds.shape[-1])
    total = x.pow(2).mean()
    return float(x.mean((0, 1)).pow(2).mean() / total), float((x - x.mean(0)).pow(2).mean() / total)


def test_centered_positions_and_maze_statistics_let_the_frame_reach_the_language_model(tmp_path):
    # The plain sin-cos table adds one vector to every patch (its low-frequency cosines are
    # near 1 everywhere), and with 0.5 / 0.5 normalization white floor and gray wall are one
    # direction at two scales: the image embeddings are mostly one shared vector.
    plain = build_model("tiny", tmp_path / "p", arch="qwen3_vl", image_size=98, patch_size=14,
                        merge_size=1)  # fmt: skip
    balanced = build_model(
        "tiny", tmp_path / "b", arch="qwen3_vl", image_size=98, patch_size=14, merge_size=1,
        image_mean=[0.83] * 3, image_std=[0.5] * 3, position_table="centered",
    )  # fmt: skip
    table = balanced.model.model.visual.pos_embed.weight.detach()
    assert table.mean(0).abs().max() < 1e-5
    assert plain.model.model.visual.pos_embed.weight.detach().mean(0).abs().max() > 0.5
    info = json.loads((balanced.path / "clew_build.json").read_text())
    assert info["image_mean"] == [0.83] * 3 and info["position_table"] == "centered"
    _, processor = load_policy(balanced.path)
    assert list(processor.image_processor.image_mean) == [0.83] * 3
    shared_plain, content_plain = _image_embedding_shares(plain.path, 0)
    shared_balanced, content_balanced = _image_embedding_shares(balanced.path, 0)
    assert shared_balanced < shared_plain
    assert content_balanced > 2 * content_plain, (content_plain, content_balanced)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--image-mean", "0.5,0.5", "expected three numbers R,G,B"),
        ("--image-std", "0.5,0,0.5", "each > 0"),
        ("--position-table", "sin", "accepted: sincos, centered"),
        ("--arch", "qwen2_vl", "needs arch qwen3_vl"),
    ],
)
def test_init_model_refuses_bad_normalization_or_position_table(
    tmp_path, capsys, flag, value, message
):
    from clew.cli import main

    out = tmp_path / "v"
    args = ["init-model", "--preset", "tiny", "--arch", "qwen3_vl", "--output", str(out)]
    if flag == "--arch":  # a later --arch wins: qwen2_vl with the Qwen3-VL-only table
        args += ["--position-table", "centered"]
    assert main([*args, flag, value]) != 0
    assert message in capsys.readouterr().err
    assert not (out / "config.json").exists()
