"""The Triton kernel of ``clew.kernels.prefill_triton``, whose docstring gives the plan.

Loaded by ``clew.kernels.triton_loading.kernels`` alone, once compiled and once for
Triton's interpreter. As in ``split_decode_kernels``, reductions are ``tl.reduce`` with the
combine functions ``MAX`` and ``SUM``, and there is no ``tl.cdiv`` or ``tl.zeros``: the
interpreter cannot call the helpers that were jitted before it was switched on.
"""

import triton
import triton.language as tl

MAX = tl.standard._elementwise_max
SUM = tl.standard._sum_combine
LOG2E = tl.constexpr(1.4426950408889634)  # a global a kernel reads must be a constexpr


@triton.jit
def prefill_kernel(
    Q, K, V, Lengths, Starts, Out, scale, T,
    q_b, q_h, q_t, k_b, k_h, k_n, v_b, v_h, v_n, o_b, o_t, o_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr,
):  # fmt: skip
    """One (query block, KV head, row): ``BLOCK_M`` of the row's ``T x GROUP`` (position,
    query head) pairs over the KV head's columns, causally. ``PACKED``: the rows' queries
    follow one another on the position axis, row ``r``'s from ``Starts[r]`` to
    ``Starts[r + 1]`` (``T`` is then the longest row's count, the grid's bound)."""
    block = tl.program_id(0)
    kv = tl.program_id(1)
    row = tl.program_id(2)
    length = tl.load(Lengths + row).to(tl.int32)
    if PACKED:
        start = tl.load(Starts + row).to(tl.int32)
        T = tl.load(Starts + row + 1).to(tl.int32) - start
        Q = Q + start * q_t
        Out = Out + start * o_t
    first = block * BLOCK_M
    offs_m = first + tl.arange(0, BLOCK_M)
    pos = offs_m // GROUP  # the query's position in the chunk
    heads = kv * GROUP + offs_m % GROUP
    live_m = pos < T
    offs_d = tl.arange(0, BLOCK_D)
    live_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + row * q_b + heads[:, None] * q_h + pos[:, None] * q_t + offs_d[None, :],
        mask=live_m[:, None] & live_d[None, :],
        other=0.0,
    )
    # Position j sees columns up to length - T + j. The block's first position bounds the
    # columns that all its queries see (no mask needed), its last position the columns any
    # of them sees.
    limit = length - T + pos
    last = tl.minimum((first + BLOCK_M - 1) // GROUP, T - 1)
    full = tl.maximum(length - T + first // GROUP + 1, 0) // BLOCK_N * BLOCK_N
    end = tl.maximum(length - T + last + 1, 0)
    # A block past a packed row's queries reads nothing.
    full = tl.where(first < T * GROUP, full, 0)
    end = tl.where(first < T * GROUP, end, 0)
    qk_scale = scale * LOG2E
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    k_base = K + row * k_b + kv * k_h
    v_base = V + row * v_b + kv * v_h
    for n in range(0, full, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + cols[:, None] * k_n + offs_d[None, :], mask=live_d[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m, tl.reduce(scores, 1, MAX))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        v = tl.load(v_base + cols[:, None] * v_n + offs_d[None, :], mask=live_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        s = s * alpha + tl.reduce(p, 1, SUM)
        m = m_new
    for n in range(full, end, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        live_n = cols < end
        k = tl.load(
            k_base + cols[:, None] * k_n + offs_d[None, :],
            mask=live_n[:, None] & live_d[None, :],
            other=0.0,
        )
        scores = tl.dot(q, tl.trans(k)) * qk_scale
        scores = tl.where(cols[None, :] <= limit[:, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(scores, 1, MAX))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query with no column yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        v = tl.load(
            v_base + cols[:, None] * v_n + offs_d[None, :],
            mask=live_n[:, None] & live_d[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        s = s * alpha + tl.reduce(p, 1, SUM)
        m = m_new
    out = acc / tl.where(s == 0.0, 1.0, s)[:, None]  # a query of no column: zero
    tl.store(
        Out + row * o_b + pos[:, None] * o_t + heads[:, None] * o_h + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=live_m[:, None] & live_d[None, :],
    )
