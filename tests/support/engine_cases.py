"""Engine test cases shared by the kernel and engine tests: tiny policies with maze rows,
a prefill's slot buffers, Qwen3-VL-8B's attention shapes, and a comparison of two rollouts."""

from __future__ import annotations

import pytest
import torch

from clew.data.rows import generate_rows
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import RolloutSettings, play
from support.rollout_cases import ending_at_different_turns
from support.tiny import tiny_policy

KV_HEADS, GROUP, D, CAP = 2, 3, 8, 16


def chunk_case(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """Slot buffers of 4 slots, a prefill of rows in slots 1-3 (left-padded to T = 5 new
    columns): each row's lengths after the chunk, its real tokens and the masked reference's
    mask, as ``SlotCache.prefill`` builds it."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(4, KV_HEADS, CAP, D, generator=gen) for _ in range(2))
    first, t = 1, 5
    fill = torch.tensor([6, 0, 9])  # columns written before the chunk
    new = torch.tensor([5, 2, 3])  # real tokens in the chunk (the last columns of its T)
    lengths = fill + new
    query = torch.randn(3, KV_HEADS * GROUP, t, D, generator=gen)
    real = torch.arange(t)[None, :] >= (t - new)[:, None]  # [rows, T]
    col = fill[:, None] + torch.arange(t)[None, :] - (t - new)[:, None]  # a real token's column
    width = int(lengths.max())
    causal = torch.arange(width)[None, None, :] <= col[:, :, None]
    visible = torch.arange(width)[None, None, :] < lengths[:, None, None]
    mask = (causal & visible)[:, None]  # [rows, 1, T, width]
    cast = {"device": device, "dtype": dtype}
    k, v = (x.to(**cast)[first : first + 3, :, :width] for x in (keys, values))
    return query.to(**cast), k, v, lengths.to(device), mask.to(device), real


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def maze_policy(request):
    """A tiny Qwen2-VL or Qwen3-VL policy for 7 x 7 mazes, its chat format and 3 maze rows."""
    arch = request.param
    size, cell = {"qwen2_vl": (196, 28), "qwen3_vl": (224, 32)}[arch]  # 7 x 7 cells
    model, processor = load_policy(tiny_policy(arch=arch, image_size=size))
    model.eval()
    rows = generate_rows(
        "maze_2d/small", 3, env_options={"cell_px": cell, "action_format": "keyword"}
    )
    return model, ChatFormat(processor), rows


def play_with_prefill(model, chat, rows, prefill: str, keep_last_k_images=None, temperature=1.0):
    settings = RolloutSettings(
        n_samples_per_prompt=3,
        max_turns=4,
        max_input_length=4096,
        sampling=SamplingParams(temperature=temperature, max_tokens=6),
        keep_last_k_images=keep_last_k_images,
        env_workers=1,  # ending_at_different_turns counts episodes in the order they start
    )
    engine = InferenceEngine(model, chat, prefill_attention=prefill)
    return play(engine, rows, settings, seed=3, env_factory=ending_at_different_turns())


def eight_b_case(rows: int, cap: int = 2048, t: int = 140, seed: int = 0):
    """Qwen3-VL-8B's attention on the GPU (32 query heads over 8 KV heads of 128, bf16):
    chunks of ``t`` queries [rows, H, T, D] as the projection leaves them, slot buffers of
    ``cap`` columns and row lengths of 150 to ``cap``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    keys, values = (
        torch.randn(rows, 8, cap, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    query = torch.randn(
        rows, t, 32, 128, generator=gen, device="cuda", dtype=torch.bfloat16
    ).transpose(1, 2)
    lengths = torch.randint(150, cap, (rows,), generator=gen, device="cuda")
    return query, keys, values, lengths


def cuda_policy():
    """The tiny Qwen3-VL policy in bfloat16 on the GPU, its chat format and 3 maze rows."""
    model, processor = load_policy(
        tiny_policy(arch="qwen3_vl", image_size=224), dtype="bfloat16", device=torch.device("cuda")
    )
    rows = generate_rows(
        "maze_2d/small", 3, env_options={"cell_px": 32, "action_format": "keyword"}
    )
    return model.eval(), ChatFormat(processor), rows


def assert_same_until_they_part(a, b, tol: float) -> None:
    for x, y in zip(a, b, strict=True):
        pairs = list(zip(x.token_ids, y.token_ids, strict=False))
        part = next((i for i, (p, q) in enumerate(pairs) if p != q), len(pairs))
        first = x.loss_mask.index(1)  # the first generated token
        assert part > first, "the replies differ from their first token"
        lp = zip(x.logprobs[:part], y.logprobs[:part], strict=True)
        worst = max(abs(p - q) for p, q in lp)
        assert worst < tol, f"largest logprob difference before they part {worst:.2e}"
