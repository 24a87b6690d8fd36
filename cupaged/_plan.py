"""``AttentionPlan``: the schedule of one attention batch (cupaged/attention.py makes and runs it), and
the split partials' workspace: its size and how a caller's uint8 workspace is carved into them."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from cupaged._checks import address
from cupaged._interop import passes_as_is

__all__ = ["AttentionPlan", "workspace_bytes", "carve_workspace"]


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
        return workspace_bytes(self.num_tokens, self.num_heads, self.max_splits, self.v_head_size)


def workspace_bytes(num_tokens, num_heads, max_splits, head_size) -> int:
    """Bytes of split partials, all float32: max_logits, exp_sums and tmp_output (never rounded to the
    output's dtype before the merge), plus 256 for alignment."""
    n = num_tokens * num_heads * max_splits
    return 8 * n + 4 * n * head_size + 256


def carve_workspace(workspace, plan: AttentionPlan):
    """The plan's partials (max_logits, exp_sums, tmp_output) carved out of the caller's 1-D uint8
    ``workspace`` at a 256-byte boundary; None when the plan needs none or no workspace is given."""
    if workspace is None or plan.partial_shapes is None:
        return None
    need = plan.workspace_bytes
    if workspace.dtype != np.uint8 or workspace.ndim != 1 or workspace.size < need:
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
