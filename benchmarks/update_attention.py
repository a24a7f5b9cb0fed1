"""The update's attention under hidden images, one layer's call forward and backward, by kernel.

With ``generator.keep_last_k_images`` (the one-GPU maze recipe keeps 1), a padded update
micro-batch attends under a dense ``[B, 1, W, W]`` visibility mask
(``clew.models.visibility``): each query sees its causal past minus the images the engine had
hidden from it. This script builds real micro-batches of that layout, expert demonstrations of
``--env`` laid out by ``clew.train.model_batch.collate`` as the update lays them out, sorted by
length and cut into micro-batches of ``--micro-batch`` as ``PolicyForward`` cuts them, and
times one attention call of the language model's shape (``--heads`` query heads over
``--kv-heads``, ``--head-dim``; the recipe's ``medium`` preset by default) on random
queries, keys and values, forward and backward, with each kernel choice:

- ``dense`` (the baseline, today's path): transformers' SDPA under the additive mask;
- ``cudnn``: the dense mask through cuDNN's attention (CUDA only);
- ``flex`` (``trainer.flex_attention``): ``clew.models.packed_attention.flex_sdpa``, torch's
  FlexAttention compiled, under the block mask ``clew.models.visibility.visibility_block_mask``
  computes from the visibility vectors (no ``W x W`` mask in memory, blocks no query sees
  skipped; on a CPU uncompiled, forward only).

Each mask, dense or block, is built once a micro-batch (as the update builds it once for all
layers), outside the timed calls.

Printed per micro-batch width: the share of the square's blocks (128 x 128 tokens) the block
mask leaves FlexAttention to compute (``dense`` computes them all), then per kernel the
milliseconds a call (median of ``--steps`` after ``--warmup``), the speed-up over ``dense``,
and the largest difference of the outputs and of the query gradients from ``dense``'s over
the real (unpadded) queries.

    python benchmarks/update_attention.py --device cuda
    python benchmarks/update_attention.py --rows 16 --micro-batch 8 --steps 1 --warmup 0 \\
        --kernels dense
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from clew.data.rows import generate_rows
from clew.envs.base import text_corpus
from clew.models import build_model
from clew.models.chat import ChatFormat
from clew.models.packed_attention import flex_sdpa
from clew.models.visibility import visibility_block_mask, visibility_from_vectors
from clew.train.model_batch import collate
from clew.trainer.demonstrations import demonstrations

KERNELS = ("dense", "cudnn", "flex")


class _Layer(torch.nn.Module):
    """What transformers' attention functions read from the attention module."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


def micro_batches(args: argparse.Namespace) -> list:
    """The update's padded micro-batches of ``--rows`` demonstrations, sorted by length."""
    with tempfile.TemporaryDirectory() as tmp:
        built = build_model(
            "medium",
            Path(tmp) / "model",
            corpus=text_corpus(),
            arch="qwen3_vl",
            image_size=args.image_size,
            patch_size=14,
            merge_size=1,
        )
    chat = ChatFormat(built.processor)
    options = {
        "cell_px": 14,
        "border_px": 7,
        "max_turns": args.max_turns,
        "action_format": "keyword",
    }
    rows = generate_rows(args.env, args.rows, env_options=options)
    demos = demonstrations(rows, chat, detour_prob=args.detours, seed=0, start_anywhere=0.5)
    for d in demos:
        d.image_window = args.keep_last_k
    demos.sort(key=lambda d: len(d.token_ids))
    return [
        collate(demos[i : i + args.micro_batch], chat)
        for i in range(0, len(demos), args.micro_batch)
    ]


def kernels(args: argparse.Namespace, layer: _Layer) -> dict[str, Callable]:
    """Each kernel choice as ``f(q, k, v, dense_mask, block_mask) -> [B, W, H, D]``."""

    def dense(q, k, v, mask, _block_mask):
        return sdpa_attention_forward(layer, q, k, v, mask)[0]

    def cudnn(q, k, v, mask, _block_mask):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return dense(q, k, v, mask, _block_mask)

    def flex(q, k, v, _mask, block_mask):
        return flex_sdpa(layer, q, k, v, block_mask)[0]

    table = {"dense": dense, "cudnn": cudnn, "flex": flex}
    return {name: table[name] for name in args.kernels.split(",")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--env", default="maze_2d/easy")
    p.add_argument("--rows", type=int, default=96, help="demonstrations (one mini-batch)")
    p.add_argument("--micro-batch", type=int, default=48)
    p.add_argument("--max-turns", type=int, default=32)
    p.add_argument("--detours", type=float, default=0.3, help="wrong moves: longer episodes")
    p.add_argument("--keep-last-k", type=int, default=1)
    p.add_argument("--image-size", type=int, default=140)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    unknown = set(args.kernels.split(",")) - set(KERNELS)
    if unknown:
        p.error(f"unknown kernels {sorted(unknown)}; choose from {', '.join(KERNELS)}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = _Layer(args.heads, args.kv_heads).train()
    fns = kernels(args, layer)
    print(
        f"{args.env}: {args.rows} demonstrations, micro-batches of {args.micro_batch}, the "
        f"last {args.keep_last_k} image(s) kept; {args.heads}/{args.kv_heads} heads of "
        f"{args.head_dim}, {dtype}, {device}; ms a call, forward and backward"
    )
    print(f"{'width':>6} {'rows':>5} {'blocks':>7} " + " ".join(f"{n:>22}" for n in fns))
    gen = torch.Generator().manual_seed(0)
    for batch in micro_batches(args):
        b, w = batch.input_ids.shape
        lengths = torch.tensor(batch.lengths)
        hidden_below, image_of_key = batch.hidden_below.to(device), batch.image_of_key.to(device)
        allowed = visibility_from_vectors(hidden_below, image_of_key, lengths.to(device))
        block_mask = visibility_block_mask(lengths.to(device), w, hidden_below, image_of_key)
        mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=device)
        mask.masked_fill_(allowed, 0.0)
        shapes = [(b, args.heads, w, args.head_dim)] + [(b, args.kv_heads, w, args.head_dim)] * 2
        qkv = [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
        grad = torch.randn(b, w, args.heads, args.head_dim, generator=gen).to(device, dtype)
        real = torch.arange(w)[None, :] < lengths[:, None]
        cells, reference = [], None
        for fn in fns.values():
            try:
                seconds, out, dq = _timed(fn, qkv, mask, block_mask, grad, args, device)
            except Exception as exc:  # a kernel this device or torch lacks is a figure too
                cells.append(f"{'unavailable: ' + type(exc).__name__:>22}")
                continue
            out, dq = out[real.to(device)].float(), dq.transpose(1, 2)[real.to(device)].float()
            reference = reference or (seconds, out, dq)
            diff = max(
                (out - reference[1]).abs().max().item(), (dq - reference[2]).abs().max().item()
            )
            cells.append(f"{seconds * 1e3:8.2f} {reference[0] / seconds:5.2f}x {diff:7.1e}")
        print(f"{w:>6} {b:>5} {_block_share(block_mask):>7.1%} " + " ".join(cells))


def _block_share(block_mask) -> float:
    """The share of the square's blocks FlexAttention computes under ``block_mask``."""
    rows, _, q_blocks, kv_blocks = block_mask.kv_indices.shape
    computed = block_mask.kv_num_blocks.sum()
    if block_mask.full_kv_num_blocks is not None:
        computed = computed + block_mask.full_kv_num_blocks.sum()
    return float(computed) / (rows * q_blocks * kv_blocks)


def _timed(fn, qkv, mask, block_mask, grad, args, device):
    """Median seconds of forward and backward, and the last output and query gradient."""
    times = []
    for i in range(args.warmup + args.steps):
        q, k, v = (t.detach().requires_grad_() for t in qkv)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(q, k, v, mask, block_mask)
        out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out.detach(), q.grad


if __name__ == "__main__":
    main()
