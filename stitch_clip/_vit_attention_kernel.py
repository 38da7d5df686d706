"""The Triton kernel behind ``stitch_clip.attention``: full (non-causal) attention over a ViT's short rows.

One program attends ``HEADS`` heads of one image: it loads each head's whole query, key and value rows (a ViT-B/32
row is 50 tokens, padded to ``BLOCK``), takes the [BLOCK, BLOCK] scores in fp32, a softmax with the padded keys
masked out, and the value product, and writes the head's rows into an output laid out [batch, tokens, heads, dim]
(what the tower's output projection reads, so no transpose follows). Nothing in a program depends on the batch size
or on the other images: an image's features are the same bits whatever it is batched with.

Imported only where Triton is (a GPU, or ``TRITON_INTERPRET=1`` on a CPU in the tests).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def vit_attention_kernel(
    Q, K, V, Out,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_os, stride_oh,
    heads, tokens, qk_scale,
    BLOCK: tl.constexpr, DIM: tl.constexpr, HEADS: tl.constexpr,
):
    groups = heads // HEADS
    pid = tl.program_id(0)
    b = (pid // groups).to(tl.int64)  # int64: a large batch's element offsets pass 2**31
    first = (pid % groups) * HEADS
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, DIM)
    valid = rows < tokens
    for i in tl.static_range(HEADS):
        h = first + i
        q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + dims[None, :],
                    mask=valid[:, None], other=0.0)
        k = tl.load(K + b * stride_kb + h * stride_kh + rows[:, None] * stride_ks + dims[None, :],
                    mask=valid[:, None], other=0.0)
        v = tl.load(V + b * stride_vb + h * stride_vh + rows[:, None] * stride_vs + dims[None, :],
                    mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # fp32, in log2 units: the scale carries log2(e)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        weights = tl.exp2(scores - tl.max(scores, 1)[:, None])
        total = tl.sum(weights, 1)
        out = tl.dot(weights.to(v.dtype), v) / total[:, None]
        tl.store(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_os + dims[None, :],
                 out.to(Out.dtype.element_ty), mask=valid[:, None])
