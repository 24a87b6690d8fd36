"""``AttentionPlan``: the schedule of one attention batch, made here from shapes and hints (:func:`make_plan`: tiles,
splits, partial buffers, grid; cupaged/attention.py checks the arguments and runs it), and the split partials'
workspace: its size and how a caller's uint8 workspace is carved into them."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from cupaged._attention_kernels import (ALL_ROWS, HEAD_BUCKETS, MLA_BUCKET, decode_route, kernel_constants,
                                       prefill_route, reduce_kernel, resident_ctas)
from cupaged._cache_args import KV_CODE
from cupaged._checks import CTYPE, address, check_array, check_int, check_writable
from cupaged._interop import passes_as_is
from cupaged._kv_view import kv_key

__all__ = ["AttentionPlan", "workspace_bytes", "check_workspace", "carve_workspace", "make_plan", "MIN_SPLIT"]


@passes_as_is
@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """The schedule of one batch: reusable for every layer whose q and K/V have these shapes, and inside
    CUDA-graph capture (it holds no arrays and reads none)."""

    op: str                    # "decode", "prefill" or "mla_decode": the name NVTX ranges and profiles use
    num_tokens: int
    num_heads: int
    num_seqs: int
    num_kv_heads: int
    head_size: int
    v_head_size: int
    dtype: str                 # q's C type
    kv: str                    # the K/V kind and cache dtype the plan was made for
    tiles: int                 # paged_prefill_kernel's CTAs along a sequence's (token, head) rows (0: no prefill)
    kv_split_size: int         # keys per split (0: one pass)
    max_splits: int            # the depth of the partial buffers
    always_partials: bool      # vLLM v2: every sequence writes partials, even with one split
    grid: tuple
    threads: int
    shared_mem: int
    kernel: str | None         # name expressions; kernel (the prefill kernel) None: the decode kernel takes every row
    reduce_kernel: str | None
    decode_kernel: str | None = None  # a decode kernel for sequences with q_len <= decode_max_q
    decode_grid: tuple = ()
    decode_threads: int = 0
    decode_shared_mem: int = 0
    decode_tiles: int = 0      # the decode grid's row tiles of 4 or 8 rows (the kernel's ROWS)
    decode_max_q: int = 0      # 0: no decode kernel; ALL_ROWS: it takes every sequence
    decode_layout: str | None = None  # the KvView.decode_layout the decode kernel reads

    @property
    def partial_shapes(self):
        """(max_logits, exp_sums, tmp_output) shapes, or None when the plan needs no partials."""
        if self.reduce_kernel is None and not self.always_partials:
            return None
        rows = (self.num_tokens, self.num_heads, self.max_splits)
        return rows, rows, (*rows, self.v_head_size)

    @property
    def main_launches(self):
        """(kernel, grid, threads, shared_mem) of the main kernels, in launch order: paged_prefill_kernel
        for long query runs (the op's declared cost goes with the first: the bulk of a prefill), then the
        decode kernel for the short ones."""
        launches = []
        if self.kernel is not None:
            launches.append((self.kernel, self.grid, self.threads, self.shared_mem))
        if self.decode_kernel is not None:
            launches.append((self.decode_kernel, self.decode_grid, self.decode_threads, self.decode_shared_mem))
        return launches

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the ``workspace=`` that holds this plan's partials (0: it needs none)."""
        if self.partial_shapes is None:
            return 0
        return _bytes(self.num_tokens, self.num_heads, self.max_splits, self.v_head_size)


def workspace_bytes(num_tokens, num_heads, max_splits, head_size) -> int:
    """Bytes of split partials, all float32: max_logits, exp_sums and tmp_output (never rounded to the
    output's dtype before the merge), plus 256 for alignment."""
    return _bytes(check_int("num_tokens", num_tokens, 0), check_int("num_heads", num_heads, 1),
                  check_int("max_splits", max_splits, 1), check_int("head_size", head_size, 1))


def _bytes(num_tokens, num_heads, max_splits, head_size) -> int:
    n = num_tokens * num_heads * max_splits
    return 8 * n + 4 * n * head_size + 256


def check_workspace(workspace) -> None:
    """None, or a writable contiguous 1-D uint8 array (its size is checked against the plan that carves it)."""
    if workspace is None:
        return
    check_array("workspace", workspace)
    if workspace.dtype != np.uint8 or workspace.ndim != 1:
        raise ValueError(f"workspace must be a 1-D uint8 array, got {workspace.dtype} shape {tuple(workspace.shape)}")
    if workspace.size > 1 and workspace.strides[0] != 1:
        raise ValueError(f"workspace must be contiguous, got a stride of {workspace.strides[0]} bytes")
    check_writable("workspace", workspace)


def carve_workspace(workspace, plan: AttentionPlan):
    """The plan's partials (max_logits, exp_sums, tmp_output) carved out of the caller's 1-D uint8
    ``workspace`` at a 256-byte boundary; None when the plan needs none or no workspace is given."""
    check_workspace(workspace)
    if workspace is None or plan.partial_shapes is None:
        return None
    need = plan.workspace_bytes
    if workspace.size < need:
        raise ValueError(f"workspace must be a 1-D uint8 array of >= {need} bytes for {plan.max_splits} splits, got "
                         f"{workspace.dtype} shape {tuple(workspace.shape)}")
    rows = plan.partial_shapes[0]
    n = math.prod(rows)
    off = (-address(workspace)) % 256
    t = 4 * n * plan.v_head_size  # tmp_output first: its rows stay 16-byte aligned for the merge's vector loads
    tmp = workspace[off:off + t].view(np.float32)
    ml = workspace[off + t:off + t + 4 * n].view(np.float32).reshape(rows)
    es = workspace[off + t + 4 * n:off + t + 8 * n].view(np.float32).reshape(rows)
    return ml, es, tmp.reshape(*rows, plan.v_head_size)


MIN_SPLIT = 256  # keys: contexts up to this are never split


def split_for(sms: int, per_sm: int, ctas: int, max_kv: int) -> int:
    """kv_split_size=None for a grid of ``ctas`` CTAs of which ``per_sm`` fit on an SM (0 = no split), chosen from
    the batch's shape, so only a fixed kv_split_size is batch-invariant. A grid that fills >= 90% of a wave (SMs x
    resident CTAs) keeps the SMs at their occupancy and is not split (a split would only add the merge's traffic
    and launch). A smaller one splits contexts longer than MIN_SPLIT into >= 2 full waves: the fewest splits whose
    last wave is >= 90% full (a thin last wave is a latency-bound tail), else the fullest within twice the fewest."""
    wave = sms * max(per_sm, 1)
    if ctas >= 0.9 * wave or max_kv <= MIN_SPLIT:
        return 0
    ctas = max(ctas, 1)
    fewest = math.ceil(2 * wave / ctas)

    def fill(splits):  # the grid's CTAs over the waves they take
        n = ctas * math.ceil(max_kv / max(MIN_SPLIT, math.ceil(max_kv / splits)))
        return n / (math.ceil(n / wave) * wave)

    candidates = range(fewest, 2 * fewest + 1)
    splits = next((n for n in candidates if fill(n) >= 0.9), max(candidates, key=fill))
    size = max(MIN_SPLIT, math.ceil(max_kv / splits))
    return 0 if size >= max_kv else size


@functools.lru_cache(maxsize=1024)
def make_plan(q_shape, q_dtype, kind, kv_cache_dtype, num_kv_heads, v_head_size, block_size, table_width, index_len,
              decode, max_query_len, max_seq_len, kv_split_size, max_splits, always_partials, device,
              decode_layout, prefill_rows) -> AttentionPlan:
    """The plan of checked arguments (plan_attention's), memoized on them: a batch shape seen before costs a lookup."""
    num_tokens, num_heads, head_size = q_shape
    dense = table_width is None
    num_seqs = index_len - (1 if dense else 0)
    consts = kernel_constants()
    group = num_heads // num_kv_heads
    max_q = 1 if decode else min(max_query_len or num_tokens, num_tokens)
    t, kv = CTYPE[q_dtype], KV_CODE[kv_cache_dtype]
    shared = kind == "mla"
    hd = MLA_BUCKET[0] if shared else next((b for b in HEAD_BUCKETS if b >= max(head_size, v_head_size)), None)
    if hd is None:
        raise NotImplementedError(f"head_size={max(head_size, v_head_size)}: at most {HEAD_BUCKETS[-1]} is supported")
    cache_itemsize = q_dtype.itemsize if kv_cache_dtype == "auto" else 1
    sms, sm_shared = device
    # A decode kernel takes the short query runs, or every run (decode_max_q ALL_ROWS: float32, vLLM's layout, MLA,
    # or a hint saying every run is short); the tensor-core prefill kernel takes the longer ones.
    route = decode_route(kind, q_dtype, t, kv, num_heads, group, max_q, hd, cache_itemsize, decode_layout, sm_shared)
    if route is None:
        raise NotImplementedError(f"q dtype {q_dtype}: attention over an MLA latent cache takes float16 or bfloat16 q "
                                  f"(mla_decode_kernel runs on tensor cores)")
    decode_kernel, decode_max_q, decode_tiles, decode_threads, decode_smem = route
    decode_regs = 255 if kind == "mla" else 128  # the kernels' __launch_bounds__
    prefill = None if decode_max_q == ALL_ROWS else prefill_route(kind, q_dtype, t, kv, head_size, v_head_size,
                                                                  prefill_rows)
    assert decode_max_q == ALL_ROWS or prefill, "a run no kernel takes"  # 16-bit q over rows: the prefill kernel's
    tiles = -(-max_q * group // prefill[2]) if prefill else 0
    max_kv = max_seq_len or (table_width * block_size if not dense else 0)
    if prefill:  # its CTAs do the bulk of the work: its occupancy (255 registers, its shared memory)
        ctas, per_sm = num_seqs * num_kv_heads * tiles, resident_ctas(consts["PD_THREADS"], prefill[1], sm_shared, 255)
    else:  # the decode kernel alone: its occupancy (its registers and shared memory)
        ctas = num_seqs * num_kv_heads * decode_tiles
        per_sm = resident_ctas(decode_threads, decode_smem, sm_shared, decode_regs)
    split = split_for(sms, per_sm, ctas, max_kv) if kv_split_size is None else kv_split_size
    if max_splits is None:
        max_splits = max(1, -(-max_kv // split)) if split else 1
    split = split if max_splits > 1 else 0
    return AttentionPlan(
        op="mla_decode" if shared else "decode" if decode else "prefill", num_tokens=num_tokens, num_heads=num_heads,
        num_seqs=num_seqs, num_kv_heads=num_kv_heads, head_size=head_size, v_head_size=v_head_size, dtype=t,
        kv=kv_key(kind, kv_cache_dtype, block_size), tiles=tiles, kv_split_size=split, max_splits=max_splits,
        always_partials=always_partials, grid=(tiles * max_splits, num_kv_heads, num_seqs),
        threads=consts["PA_THREADS"], shared_mem=prefill[1] if prefill else 0, kernel=prefill[0] if prefill else None,
        reduce_kernel=reduce_kernel(t) if max_splits > 1 and split > 0 else None,
        decode_kernel=decode_kernel, decode_threads=decode_threads, decode_shared_mem=decode_smem,
        decode_grid=(decode_tiles * max_splits, num_kv_heads, num_seqs) if decode_kernel else (),
        decode_tiles=decode_tiles, decode_max_q=decode_max_q, decode_layout=decode_layout if decode_kernel else None)
