"""``AttentionPlan``: the schedule of one attention batch, made here from shapes and hints (:func:`make_plan`,
memoized on a :class:`PlanKey`: the kernels' launches, splits, partial buffers; cupaged/attention.py checks the
arguments and runs it), and the split partials' workspace: its size and how a caller's uint8 workspace is carved into
them. :func:`split_for` chooses the split size and :func:`split_count` counts the splits: Python's one owner of both."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import numpy as np

from cupaged._attention_kernels import ALL_ROWS, decode_route, merge_launch, prefill_route
from cupaged._cache_args import KV_CODE
from cupaged._checks import CTYPE, address, check_array, check_int, check_writable
from cupaged._interop import passes_as_is
from cupaged._kv_view import kv_key
from cupaged._launch import Launch

__all__ = ["AttentionPlan", "PlanKey", "workspace_bytes", "check_workspace", "carve_workspace", "make_plan",
           "split_count", "MIN_SPLIT"]


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
    kv_split_size: int         # keys per split (0: one pass)
    max_splits: int            # the depth of the partial buffers
    always_partials: bool      # vLLM v2: every sequence writes partials, even with one split
    # The main kernels in launch order: paged_prefill_kernel for long query runs when the plan has one (the op's
    # declared cost goes with the first: the bulk of a prefill), then the decode kernel for the short ones.
    launches: tuple[Launch, ...]
    merge: Launch | None       # the split merge (None: no sequence is split)
    # The kernels' run-time parameters (PaParams): each grid's x is its row tiles x max_splits
    tiles: int                 # paged_prefill_kernel's row tiles of a sequence (0 without a prefill kernel)
    decode_tiles: int          # the decode kernel's row tiles (4 or 8 rows: its ROWS; MLA: head tiles x queries)
    decode_max_q: int          # the longest run the decode kernel takes (ALL_ROWS: every run)
    decode_layout: str         # the KvView.decode_layout the decode kernel reads
    prior_state: bool = False  # cascade: the kernels write partials only, the merge folds in a prior (out, LSE)
    arch: str = "sm_80"        # the architecture whose kernels it launches ("sm_90": the Hopper prefill kernel)

    @property
    def partial_shapes(self):
        """(max_logits, exp_sums, tmp_output) shapes, or None when the plan needs no partials."""
        if self.merge is None and not self.always_partials:
            return None
        rows = (self.num_tokens, self.num_heads, self.max_splits)
        return rows, rows, (*rows, self.v_head_size)

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
    and launch). A smaller one splits contexts longer than MIN_SPLIT: the fewest splits whose grid fills >= 90% of
    a wave and of its last wave (a thin last wave is a latency-bound tail), else the fullest within twice the
    fewest. Each split more writes and merges one more partial row per (token, head): one wave of long splits
    reads the same K/V bytes as two of short ones, with half the partials (MLA's 16 heads, 64 x 4096: 4 splits,
    not 12)."""
    wave = sms * max(per_sm, 1)
    if ctas >= 0.9 * wave or max_kv <= MIN_SPLIT:
        return 0
    ctas = max(ctas, 1)
    fewest = math.ceil(0.9 * wave / ctas)

    def fill(splits):  # the grid's CTAs over the waves they take
        n = ctas * split_count(max_kv, max(MIN_SPLIT, math.ceil(max_kv / splits)))
        return n / (math.ceil(n / wave) * wave)

    candidates = range(fewest, 2 * fewest + 1)
    splits = next((n for n in candidates if fill(n) >= 0.9), max(candidates, key=fill))
    size = max(MIN_SPLIT, math.ceil(max_kv / splits))
    return 0 if size >= max_kv else size


def split_count(max_kv: int, kv_split_size: int) -> int:
    """Splits of ``kv_split_size`` keys that cover ``max_kv`` keys (0 for none): the partial buffers' depth, vLLM's
    max_num_partitions."""
    return -(-max_kv // kv_split_size)


class PlanKey(NamedTuple):
    """What a plan depends on, and all it depends on (make_plan is memoized on it): the shapes of q and the index
    arrays, what the plan reads of the K/V, the caller's hints and split options, and the device. A named tuple:
    built and hashed on every op call, at a fraction of a frozen dataclass's cost."""

    q_shape: tuple             # (num_tokens, num_heads, head_size)
    q_dtype: np.dtype
    kind: str                  # KvView.kind
    kv_cache_dtype: str
    num_kv_heads: int
    v_head_size: int
    block_size: int
    table_width: int | None    # block_tables' columns (None: dense K/V rows)
    index_len: int             # seq_lens' length (dense rows: cu_seqlens_k's)
    decode: bool               # no query_start_loc: one query a sequence
    max_query_len: int | None  # the hints (None: sized from the shapes)
    max_seq_len: int | None
    kv_split_size: int | None  # None: split_for chooses
    max_splits: int | None     # None: the splits of the longest context
    always_partials: bool
    sms: int                   # the device's SMs
    sm_shared: int             # and shared memory an SM
    decode_layout: str         # KvView.decode_layout
    prefill_rows: bool         # KvView.prefill_rows
    min_query_len: int | None = None  # a hint: every run has at least this many queries (none: the decode kernel's)
    prior_state: bool = False         # AttentionPlan.prior_state
    arch: str = "sm_80"               # AttentionPlan.arch

    @property
    def num_tokens(self) -> int:
        return self.q_shape[0]

    @property
    def num_heads(self) -> int:
        return self.q_shape[1]

    @property
    def head_size(self) -> int:
        return self.q_shape[2]

    @property
    def num_seqs(self) -> int:
        return self.index_len - (1 if self.table_width is None else 0)

    @property
    def group(self) -> int:
        """Query heads a kv head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def max_q(self) -> int:
        """The longest query run the grid is sized for."""
        return 1 if self.decode else min(self.max_query_len or self.num_tokens, self.num_tokens)

    @property
    def max_kv(self) -> int:
        """The longest context the grid is sized for (0: dense rows without a hint, one pass)."""
        return self.max_seq_len or (self.table_width * self.block_size if self.table_width is not None else 0)

    @property
    def ctype(self) -> str:
        return CTYPE[self.q_dtype]

    @property
    def kv_code(self) -> str:
        return KV_CODE[self.kv_cache_dtype]

    @property
    def cache_itemsize(self) -> int:
        return self.q_dtype.itemsize if self.kv_cache_dtype == "auto" else 1


def _over_splits(launch: Launch, splits: int) -> Launch:
    """``launch`` with its grid's x repeated for each KV split (a kernel's CTA x is split x row tiles + row tile)."""
    x, y, z = launch.grid
    return Launch(launch.kernel, (x * splits, y, z), launch.block, launch.shared_mem)


@functools.lru_cache(maxsize=1024)
def make_plan(key: PlanKey) -> AttentionPlan:
    """The plan of checked arguments (plan_attention's), memoized on them: a batch shape seen before costs a lookup.
    A decode kernel takes the short query runs, or every run (decode_max_q ALL_ROWS: float32, vLLM's layout, MLA, or
    a hint saying every run is short); the tensor-core prefill kernel takes the longer ones."""
    decode = decode_route(key)
    prefill = None if decode.max_q == ALL_ROWS else prefill_route(key)
    assert decode.max_q == ALL_ROWS or prefill, "a run no kernel takes"  # 16-bit q over rows: the prefill kernel's
    # a min_query_len hint past the decode kernel's runs: no decode launch, and the prefill kernel takes every run
    # (a hint that overstates costs speed, never rows)
    short_runs = not prefill or (key.min_query_len or 0) <= decode.max_q
    main = prefill or decode  # its CTAs do the bulk of the work: its occupancy is what a split fills
    split = key.kv_split_size
    if split is None:
        split = split_for(key.sms, main.per_sm, math.prod(main.launch.grid), key.max_kv)
    max_splits = key.max_splits
    if max_splits is None:
        max_splits = max(1, split_count(key.max_kv, split)) if split else 1
    split = split if max_splits > 1 else 0
    return AttentionPlan(
        op="mla_decode" if key.kind == "mla" else "decode" if key.decode else "prefill", num_tokens=key.num_tokens,
        num_heads=key.num_heads, num_seqs=key.num_seqs, num_kv_heads=key.num_kv_heads, head_size=key.head_size,
        v_head_size=key.v_head_size, dtype=key.ctype, kv=kv_key(key.kind, key.kv_cache_dtype, key.block_size),
        kv_split_size=split, max_splits=max_splits, always_partials=key.always_partials,
        launches=tuple(_over_splits(route.launch, max_splits)
                       for route in (prefill, decode if short_runs else None) if route),
        merge=merge_launch(key) if split > 0 or key.prior_state else None,
        tiles=prefill.launch.grid[0] if prefill else 0, decode_tiles=decode.launch.grid[0],
        decode_max_q=decode.max_q if short_runs else 0,
        decode_layout=key.decode_layout, prior_state=key.prior_state, arch=key.arch)
