"""Exports load anywhere: `clew export --merge` and SFT's exports are standard Hugging Face
Qwen-VL directories, and the LoRA adapter export loads with plain peft and names the
modules vLLM's Qwen3-VL LoRA loader accepts.

Each case builds a base, trains nothing but gives a LoRA adapter random weights, exports it
as GRPO does (``PolicyWorker.save_pretrained`` + the processor) and merges it with `clew
export --merge`. The "plain" side runs ``tests/support/plain_transformers.py`` in a process
that never imports clew. Which test needs what:

- ``test_a_clean_process_with_auto_processor_gets_clews_greedy_tokens`` needs torchvision
  (transformers' Qwen-VL ``AutoProcessor`` builds a video processor, which imports it), and
  torchvision does not import beside the CPU torch clew installs. It carries the ``gpu``
  marker so it runs on the GPU machine, whose image has torchvision: ``pytest -m gpu
  tests/models/test_export.py``. Elsewhere it is skipped unless ``CLEW_TORCHVISION_PYTHON`` names a
  Python that has torch, torchvision and transformers (then ``-m gpu`` runs it there too).
- every other test runs on the CPU with clew's own venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.tiny import tiny_policy

from clew.cli import main
from clew.cluster.group import LocalWorkerGroup
from clew.envs import make
from clew.inference.runtime import open_policy
from clew.inference.sampling import SamplingParams
from clew.models import load_policy, load_processor
from clew.models.adapter_loading import load_adapter
from clew.train.settings import WorkerSettings
from clew.train.worker import PolicyWorker

PLAIN = Path(__file__).parents[1] / "support" / "plain_transformers.py"
MAX_NEW_TOKENS = 12

# name -> how the base is made: clew's builder (arch, dtype, frame size), or the real-format
# Qwen3-VL checkpoint of ``tests/support/real_qwen3vl.py``. Frames are a multiple of patch x
# merge inside the processor's pixel bounds, so no processor resizes them: PIL and torchvision
# processors then differ only by float rounding.
CASES: dict[str, dict] = {
    "clew-qwen2_vl-fp32": {"arch": "qwen2_vl", "dtype": "float32", "image_size": 140},
    "clew-qwen3_vl-bf16": {"arch": "qwen3_vl", "dtype": "bfloat16", "image_size": 256},
    "hub-qwen3_vl-bf16": {"arch": "qwen3_vl", "dtype": "bfloat16", "hub": True},
}
FRAMES = {140: {"cell_px": 28}, 256: {"cell_px": 48, "border_px": 8}}
PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
VIDEO_PROCESSORS = {"qwen2_vl": "Qwen2VLVideoProcessor", "qwen3_vl": "Qwen3VLVideoProcessor"}


@dataclass
class Case:
    name: str
    arch: str
    dtype: str
    hub: bool
    base: Path
    adapter: Path
    merged: Path
    frame_size: int


def _random_adapter(base: Path, out: Path) -> None:
    """A LoRA adapter exported as GRPO exports one (``clew.cluster.group``'s ``export``)."""
    worker = PolicyWorker.from_pretrained(base, WorkerSettings(lora_rank=4, lora_alpha=8))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in worker.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    worker.save_pretrained(out)
    worker.chat.processor.save_pretrained(out)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, one_thread) -> Case:
    spec = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    if spec.get("hub"):
        base = request.getfixturevalue("real_qwen3vl_dir")
        frame_size = 256
    else:
        frame_size = spec["image_size"]
        base = tiny_policy(arch=spec["arch"], dtype=spec["dtype"], image_size=frame_size)
    _random_adapter(base, root / "adapter")
    merged = root / "merged"
    argv = ["export", "--model", str(base), "--adapter", str(root / "adapter"), "--merge"]
    assert main([*argv, "--output", str(merged)]) == 0
    return Case(
        request.param,
        spec["arch"],
        spec["dtype"],
        bool(spec.get("hub")),
        Path(base),
        root / "adapter",
        merged,
        frame_size,
    )


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _weight_dtypes(directory: Path) -> set[str]:
    dtypes = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            names = f.keys()  # a safe_open handle is not iterable
            dtypes |= {str(f.get_tensor(k).dtype).removeprefix("torch.") for k in names}
    return dtypes


def _observation(case: Case):
    env = make("maze_2d/tiny", **FRAMES[case.frame_size])
    obs = env.reset(seed=3)
    assert obs.images[0].size == (case.frame_size, case.frame_size)
    return obs


def _plain(*args: str, python: str = sys.executable) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [python, str(PLAIN), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]


def _clew_greedy(case: Case) -> tuple[list[int], list[int]]:
    """Clew's engine on the merged export: the prompt's token ids and its greedy reply."""
    policy = open_policy(case.merged, device="cpu", dtype="float32")
    obs = _observation(case)
    chunk = policy.chat.user_turn(obs.text, obs.images, first=True)
    batch = policy.engine.open_batch(1, seed=0)
    (seq,) = batch.rows
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    reply = batch.extend_and_generate({seq: chunk}, params)[seq]
    return chunk.token_ids, reply.token_ids


def _processor_inputs(directory: Path, case: Case) -> dict[str, torch.Tensor]:
    """The model inputs for the maze turn, built by clew's processor through the standard
    processor API (chat template, then text and images)."""
    processor = load_processor(directory)
    obs = _observation(case)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": obs.text}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return dict(processor(text=[text], images=obs.images, return_tensors="pt"))


# -- the merged export ---------------------------------------------------------------------
def test_the_merged_export_is_a_standard_hugging_face_directory(case):
    out = case.merged
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "processor_config.json",
        "video_preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    } <= names
    # The chat template in the file the base kept it in.
    template = "chat_template.json" if case.hub else "chat_template.jinja"
    assert template in names and (
        {"chat_template.json", "chat_template.jinja"} - {template}
    ).isdisjoint(names)
    name = PROCESSORS[case.arch]
    for file in ("processor_config.json", "tokenizer_config.json", "preprocessor_config.json"):
        assert _json(out / file)["processor_class"] == name, file
    image = _json(out / "preprocessor_config.json")
    assert image["image_processor_type"] == "Qwen2VLImageProcessor"
    assert _json(out / "processor_config.json")["image_processor"] == {
        k: v for k, v in image.items() if k != "processor_class"
    }
    video = _json(out / "video_preprocessor_config.json")
    assert video["video_processor_type"] == VIDEO_PROCESSORS[case.arch]
    assert _json(out / "processor_config.json")["video_processor"] == {
        k: v for k, v in video.items() if k != "processor_class"
    }
    # Weights and config in the base's dtype.
    assert _weight_dtypes(out) == {case.dtype}
    assert _json(out / "config.json")["dtype"] == case.dtype
    assert "clew" not in json.dumps(_json(out / "processor_config.json"))


def test_the_image_processor_config_loads_with_clews_settings(case):
    from transformers import Qwen2VLImageProcessor, Qwen2VLImageProcessorPil

    used = load_processor(case.base).image_processor
    for cls in (Qwen2VLImageProcessorPil, Qwen2VLImageProcessor):
        loaded = cls.from_pretrained(case.merged, local_files_only=True)
        for key in ("patch_size", "merge_size", "temporal_patch_size", "do_resize", "resample"):
            assert getattr(loaded, key) == getattr(used, key), key
        assert list(loaded.image_mean) == list(used.image_mean)
        assert list(loaded.image_std) == list(used.image_std)
        assert dict(loaded.size) == dict(used.size)


def test_the_generation_config_is_the_bases(case):
    base = case.base / "generation_config.json"
    assert (case.merged / "generation_config.json").read_text() == base.read_text()


def test_a_base_without_generation_config_gets_one_that_stops_on_im_end(case, tmp_path):
    if case.name != "clew-qwen2_vl-fp32":
        pytest.skip("one case suffices")
    base = tmp_path / "base"
    shutil.copytree(case.base, base)
    (base / "generation_config.json").unlink()
    out = tmp_path / "out"
    argv = ["export", "--model", str(base), "--adapter", str(case.adapter), "--merge"]
    assert main([*argv, "--output", str(out)]) == 0
    tok = load_processor(base).tokenizer
    eos = _json(out / "generation_config.json")["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos and tok.eos_token_id in eos


def test_clew_loads_the_export_with_the_adapters_outputs(case):
    inputs = _processor_inputs(case.base, case)
    merged, _ = load_policy(case.merged)
    adapted = load_adapter(load_policy(case.base)[0], case.adapter)
    with torch.no_grad():
        got, want = merged(**inputs).logits, adapted(**inputs).logits
    # bf16 exports round the merged weights once.
    tol = {"atol": 1e-4, "rtol": 1e-4} if case.dtype == "float32" else {"atol": 0.1, "rtol": 0.1}
    torch.testing.assert_close(got, want, **tol)


def test_plain_transformers_model_gives_clews_greedy_tokens(case, tmp_path):
    """``AutoModelForImageTextToText`` alone (no processor, so no torchvision), in a process
    that never imports clew, on inputs built by clew's processor."""
    prompt_ids, clew_tokens = _clew_greedy(case)
    inputs = _processor_inputs(case.merged, case)
    assert inputs["input_ids"][0].tolist() == prompt_ids
    torch.save(inputs, tmp_path / "inputs.pt")
    _plain(
        "generate-inputs",
        str(case.merged),
        str(tmp_path / "inputs.pt"),
        str(MAX_NEW_TOKENS),
        str(tmp_path / "out.json"),
    )
    assert _json(tmp_path / "out.json")["tokens"] == clew_tokens


def _torchvision_python() -> str:
    python = os.environ.get("CLEW_TORCHVISION_PYTHON", sys.executable)
    probe = subprocess.run(
        [python, "-c", "import torchvision, transformers"], capture_output=True, timeout=300
    )
    if probe.returncode != 0:
        # pytest.importorskip only catches ImportError; beside clew's CPU torch, torchvision
        # fails with a RuntimeError (``operator torchvision::nms does not exist``).
        pytest.skip(f"torchvision is not importable by {python} (set CLEW_TORCHVISION_PYTHON)")
    return python


@pytest.mark.gpu
def test_a_clean_process_with_auto_processor_gets_clews_greedy_tokens(case, tmp_path):
    """``AutoProcessor`` + ``AutoModelForImageTextToText`` + the chat template, as a user
    without clew would load the export; needs torchvision (module docstring)."""
    python = _torchvision_python()
    prompt_ids, clew_tokens = _clew_greedy(case)
    obs = _observation(case)
    obs.images[0].save(tmp_path / "frame.png")
    out = tmp_path / "out.json"
    _plain(
        "generate",
        str(case.merged),
        str(tmp_path / "frame.png"),
        obs.text,
        str(MAX_NEW_TOKENS),
        str(out),
        python=python,
    )
    result = _json(out)
    assert result["processor"] == PROCESSORS[case.arch]
    assert result["input_ids"] == prompt_ids
    assert result["tokens"] == clew_tokens


# -- sharding and bad input ------------------------------------------------------------------
def test_a_small_shard_size_writes_an_index_and_loads_the_same(case, tmp_path):
    if case.name != "clew-qwen2_vl-fp32":
        pytest.skip("one case suffices")
    out = tmp_path / "sharded"
    argv = ["export", "--model", str(case.base), "--adapter", str(case.adapter), "--merge"]
    assert main([*argv, "--output", str(out), "--max-shard-size", "1MB"]) == 0
    index = _json(out / "model.safetensors.index.json")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert not (out / "model.safetensors").exists()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(
            load_policy(out)[0](input_ids=ids).logits,
            load_policy(case.merged)[0](input_ids=ids).logits,
        )


def test_a_bad_shard_size_is_refused_with_the_accepted_forms(case, tmp_path, capsys):
    if case.name != "clew-qwen2_vl-fp32":
        pytest.skip("one case suffices")
    argv = ["export", "--model", str(case.base), "--adapter", str(case.adapter), "--merge"]
    assert main([*argv, "--output", str(tmp_path / "x"), "--max-shard-size", "5 parsecs"]) == 2
    err = capsys.readouterr().err
    assert "--max-shard-size" in err and "'5 parsecs'" in err and "5GB" in err
    assert not (tmp_path / "x").exists()


# -- SFT's exports -----------------------------------------------------------------------------
@pytest.mark.parametrize("lora_rank", [4, 0])
def test_sfts_export_is_standard_and_in_the_bases_dtype(case, tmp_path, lora_rank):
    if case.name != "clew-qwen3_vl-bf16":
        pytest.skip("one case suffices")
    worker = PolicyWorker.from_pretrained(case.base, WorkerSettings(lora_rank=lora_rank))
    LocalWorkerGroup(worker).write_policy(tmp_path / "policy")
    out = tmp_path / "policy"
    assert _json(out / "processor_config.json")["processor_class"] == "Qwen3VLProcessor"
    assert _weight_dtypes(out) == {"bfloat16"}
    # The worker goes on training in float32.
    assert {p.dtype for p in worker.model.parameters()} == {torch.float32}
    model, processor = load_policy(out)
    assert type(processor).__name__ in ("ClewVLProcessor", "Qwen3VLProcessor")


# -- the adapter export ------------------------------------------------------------------------
def test_the_adapter_loads_with_plain_peft_with_clews_logits(case, tmp_path):
    inputs = _processor_inputs(case.base, case)
    torch.save(inputs, tmp_path / "inputs.pt")
    _plain(
        "peft-logits",
        str(case.base),
        str(case.adapter),
        str(tmp_path / "inputs.pt"),
        str(tmp_path / "logits.pt"),
    )
    model = load_adapter(load_policy(case.base)[0], case.adapter)
    with torch.no_grad():
        want = model(**inputs).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want, atol=1e-5, rtol=1e-4)


# vLLM's Qwen3-VL LoRA loading, as read in its source (docs/exports.md names the files and
# commits); vLLM cannot be installed here, so its rule is restated for the check.
VLLM_QWEN3_VL_PREFIXES = {
    "model.visual.": "visual.",
    "lm_head.": "language_model.lm_head.",
    "model.language_model.": "language_model.model.",
}
VLLM_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
VLLM_LANGUAGE_LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _vllm_module(key: str) -> tuple[str, bool]:
    """``parse_fine_tuned_lora_name`` with Qwen3-VL's ``hf_to_vllm_mapper``."""
    assert key.startswith("base_model.model."), key
    name = key.removeprefix("base_model.model.")
    for old, new in VLLM_QWEN3_VL_PREFIXES.items():
        if name.startswith(old):
            name = new + name.removeprefix(old)
    parts = name.split(".")
    assert parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"), key
    return ".".join(parts[:-2]), parts[-2] == "lora_A"


def test_the_adapter_names_the_modules_vllm_loads_for_qwen3_vl(case):
    if case.arch != "qwen3_vl":
        pytest.skip("vLLM's Qwen3-VL mapping")
    expected = {sub for packed in VLLM_PACKED.values() for sub in packed} | {"o_proj", "down_proj"}
    config = _json(case.adapter / "adapter_config.json")
    # PEFTHelper's required fields and the features vLLM refuses.
    assert config["r"] > 0 and config["lora_alpha"] and config["target_modules"]
    assert not config.get("modules_to_save") and not config.get("use_dora")
    assert config.get("bias", "none") == "none"
    with safe_open(case.adapter / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    modules = {}
    for key in keys:
        module, is_a = _vllm_module(key)
        modules.setdefault(module, set()).add(is_a)
        # from_local_checkpoint: the last part must be an expected LoRA module.
        assert module.rsplit(".", 1)[-1] in expected, key
        # The language model's punica wrapper serves the prefix "language_model".
        assert module.startswith("language_model.model.layers."), key
    assert all(v == {True, False} for v in modules.values())  # an A and a B per module
    # Each maps onto a vLLM layer: packed q/k/v -> qkv_proj, gate/up -> gate_up_proj.
    packed_of = {sub: packed for packed, subs in VLLM_PACKED.items() for sub in subs}
    layers = {
        m.rsplit(".", 1)[0] + "." + packed_of.get(m.rsplit(".", 1)[1], m.rsplit(".", 1)[1])
        for m in modules
    }
    assert {layer.rsplit(".", 1)[1] for layer in layers} == set(VLLM_LANGUAGE_LINEAR)
