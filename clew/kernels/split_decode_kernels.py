"""The Triton kernels of ``clew.kernels.split_decode``, whose docstring gives the plan.

Loaded by ``split_decode._kernels`` alone, once compiled and once for Triton's interpreter.
Reductions are ``tl.reduce`` with the combine functions that ``tl.max`` and ``tl.sum`` pass
it (``MAX``, ``SUM``), not those two: they are jitted when triton is first imported (torch
imports it), and Triton's interpreter cannot call them unless ``TRITON_INTERPRET`` was set
by then, while it computes a reduction by one of these two combine functions with numpy.
For the same reason there is no ``tl.cdiv`` or ``tl.zeros``.
"""

import triton
import triton.language as tl

MAX = tl.standard._elementwise_max
SUM = tl.standard._sum_combine


@triton.jit
def split_kernel(
    Q, K, V, Lengths, Part, Lse, scale,
    q_b, q_h, k_b, k_h, k_n, v_b, v_h, v_n, p_b, p_h, p_s, l_b, l_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """One (row, KV head, split): the split's output [group, D] and log-sum-exp [group]."""
    row = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(Lengths + row).to(tl.int32)
    # The split's columns: the row's share, rounded up to whole blocks.
    per = ((length + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, length)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    live_h = offs_h < GROUP
    live_d = offs_d < HEAD_DIM
    heads = kv * GROUP + offs_h
    q = tl.load(
        Q + row * q_b + heads[:, None] * q_h + offs_d[None, :],
        mask=live_h[:, None] & live_d[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    s = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, dtype=tl.float32)
    k_base = K + row * k_b + kv * k_h
    v_base = V + row * v_b + kv * v_h
    for n in range(start, end, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        live_n = cols < end
        k = tl.load(
            k_base + cols[:, None] * k_n + offs_d[None, :],
            mask=live_n[:, None] & live_d[None, :],
            other=0.0,
        )
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(live_n[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(scores, 1, MAX))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(
            v_base + cols[:, None] * v_n + offs_d[None, :],
            mask=live_n[:, None] & live_d[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        s = s * alpha + tl.reduce(p, 1, SUM)
        m = m_new
    empty = s == 0.0  # a split past the row's end
    out = acc / tl.where(empty, 1.0, s)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, s)))
    tl.store(
        Part + row * p_b + heads[:, None] * p_h + split * p_s + offs_d[None, :],
        out,
        mask=live_h[:, None] & live_d[None, :],
    )
    tl.store(Lse + row * l_b + heads * l_h + split, lse, mask=live_h)


@triton.jit
def combine_kernel(
    Part, Lse, Out, p_b, p_h, p_s, l_b, l_h, o_b, o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One (row, query head): the splits' outputs weighted by their softmax mass."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    live_s = offs_s < SPLITS
    lse = tl.load(Lse + row * l_b + head * l_h + offs_s, mask=live_s, other=float("-inf"))
    top = tl.reduce(lse, 0, MAX)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row of no column: output 0
    w = tl.exp(lse - top)
    part = tl.load(
        Part + row * p_b + head * p_h + offs_s[:, None] * p_s + offs_d[None, :],
        mask=live_s[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    total = tl.reduce(w, 0, SUM)
    out = tl.reduce(part * w[:, None], 0, SUM) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        Out + row * o_b + head * o_h + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM
    )
