"""Benchmark of one step of the consumer layer (cupaged/layers.py): ``Attention.forward`` with ``attn_type="self"``
-- fused QKV projection, QK RMSNorm, rope_and_cache, paged attention, output projection -- achieved GB/s and % of
peak.

Configs (fp16, QK-norm, NeoX RoPE, block_size 16): a decode step of ``b`` sequences with ``ctx`` cached tokens
each, and the same step with one new sequence's prefill chunk of ``chunk`` tokens mixed in. The plan is made and
uploaded once per step, as every layer of a model reuses it; the timed call is one layer's forward. The caches
hold a constant (the values do not change the work). Bytes moved = the weights (wqkv, wo) and the step's x and
output, the KV rows attention reads (the cached context and the step's tokens) and the new K/V rows written.

GPU: CUDA events, L2 flushed between reps, an NVTX range per config. Sim (no GPU): one tiny step as a smoke test
(CPU timings of the simulator, not GPU timings). ``--model`` (sim): no rows -- the layer's kernels have theirs in
bench_rope.py and bench_paged_attention.py, and the projections are cuBLAS GEMMs the H200 model does not cover --
an empty table.

    python profiling/bench_layers.py [--json out.json] [--model]
    nsys profile -t cuda,nvtx python profiling/bench_layers.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

import cupaged  # noqa: E402
from cupaged.layers import Attention  # noqa: E402


def step(xp, alloc, batch, context, chunk, heads, kv_heads, head_dim, block_size=16):
    """``batch`` sequences of ``context`` cached tokens decoding one token each, plus a new sequence's prefill
    chunk of ``chunk`` tokens when ``chunk``."""
    rng = np.random.default_rng(0)
    dim, dtype = heads * head_dim, np.float16
    attn = Attention(heads, kv_heads, dim, head_dim=head_dim, fuse_qkv=True, use_qk_normalization=True,
                     rope=cupaged.RotaryEmbedding(head_dim), dtype=dtype)
    qkv_rows = (heads + 2 * kv_heads) * head_dim
    attn.load_state_dict({
        "wqkv": xp.asarray((rng.standard_normal((qkv_rows, dim), np.float32) / np.sqrt(dim)).astype(dtype)),
        "wo": xp.asarray((rng.standard_normal((dim, dim), np.float32) / np.sqrt(dim)).astype(dtype)),
        "q_norm": xp.asarray(np.ones(head_dim, dtype)), "k_norm": xp.asarray(np.ones(head_dim, dtype))})
    num_blocks = batch * -(-(context + 1) // block_size) + -(-chunk // block_size)
    pool = cupaged.BlockPool(num_blocks, block_size)
    kv = cupaged.KVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype, xp=xp)
    kv.key(0).fill(0.01)
    kv.value(0).fill(0.01)
    for i in range(batch):
        pool.append(i, context)
    plan = pool.plan([(i, 1) for i in range(batch)] + ([("chunk", chunk)] if chunk else []))
    x = xp.asarray((rng.standard_normal((plan.num_tokens, dim), np.float32)).astype(dtype))
    attn.forward(x, plan, kv, 0)  # uploads the plan and the RoPE table, as a model's first layer does
    row_bytes = kv_heads * head_dim * 2  # one token's K or V row, fp16
    nbytes = (qkv_rows + dim) * dim * 2 + 2 * x.nbytes + 2 * row_bytes * (int(plan.seq_lens.sum()) + plan.num_tokens)
    label = f"attention self b={batch} ctx={context}{f' +chunk {chunk}' if chunk else ''} h={heads}/{kv_heads} " \
            f"d={head_dim} fp16 qknorm rope"
    return label, (lambda: attn.forward(x, plan, kv, 0)), nbytes


GPU = [(step, (64, 4096, 0, 32, 8, 128)), (step, (64, 4096, 512, 32, 8, 128)), (step, (8, 16384, 0, 64, 8, 128))]
SIM = [(step, (3, 40, 0, 4, 2, 64)), (step, (3, 40, 17, 4, 2, 64))]


def main(argv=None):
    _bench.run_bandwidth_table(GPU, SIM, (), "layers", argv, __doc__)


if __name__ == "__main__":
    main()
