"""The attention engine over kernels_cu/paged_attention.cu: describe the K/V (:class:`KvView`), plan
once per batch (:func:`plan_attention`, pure host: kernel launches, splits, partial buffers), run every
layer with that plan (:func:`run_attention`, launches after its per-call checks). Both check their
arguments (shapes, dtypes, flags, finite scales; never the contents of an array). Every attention op
(paged_attention, paged_attention_v1/v2, varlen_attention, mla_decode, mla_chunked_prefill) validates
its arguments with the same checks (cupaged/_attention_args.py), then plans (:func:`plan_checked`) and runs.

The kernel's constants and its parameter struct are read from the ``.cu`` source (cupaged/_mirror.py),
the one owner of both; cupaged/_attention_kernels.py names the kernels and their shared memory, and
cupaged/_plan.py schedules them (an AttentionPlan's launches).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import numpy as np

from cupaged._annotate import _OFF, declare_launch, op_range
from cupaged._attention_args import (MAX_HEAD_SIZE, check_heads, check_q, check_tables, check_window, check_written,
                                    softmax_scales)
from cupaged._attention_kernels import FAMILY, HEAD_BUCKETS, MLA_BUCKET, family_of, kernel_constants, tree_kernel
from cupaged._backend import (capturing, check_arch, device_arch, device_shared_limit, empty, module_of, on_sim,
                              sm_count, sm_shared_bytes, struct_arg)
from cupaged._cache_args import kv_dtype_name, kv_scale_args
from cupaged._checks import CTYPE, check_bool, check_last_contiguous, check_optional_int, element_strides
from cupaged._cost import attention_cost
from cupaged._custom_mask import check_custom_mask, packed_custom_mask
from cupaged._kv_view import KvView
from cupaged._launch import Launch
from cupaged._plan import AttentionPlan, PlanKey, carve_workspace, make_plan, workspace_bytes
from cupaged._interop import accepts_foreign_arrays
from cupaged._mirror import struct_dtype

__all__ = ["KvView", "AttentionPlan", "Launch", "plan_attention", "run_attention", "workspace_bytes", "carve_workspace",
           "FAMILY", "HEAD_BUCKETS", "MLA_BUCKET"]


@functools.lru_cache(maxsize=None)
def params_dtype() -> np.dtype:
    """struct PaParams of kernels_cu/paged_attention.cu."""
    return struct_dtype(FAMILY.source, "PaParams")


@functools.lru_cache(maxsize=None)
def _params_packer():
    """(PaParams' dtype, a getter of its fields' values in declaration order from a dict)."""
    dtype = params_dtype()
    return dtype, operator.itemgetter(*dtype.names)


@functools.lru_cache(maxsize=1024)
def _packed_params(values: tuple) -> np.ndarray:
    """struct PaParams of these field values, packed in one step and memoized: a layer loop launches
    the same few parameter sets again and again (the array is never written after packing)."""
    return np.array(values, _params_packer()[0])


@accepts_foreign_arrays
def plan_attention(q, kv: KvView, block_tables, seq_lens, query_start_loc=None, *, max_query_len=None,
                   max_seq_len=None, kv_split_size=None, max_splits=None, always_partials=False, min_query_len=None,
                   prior_state=False, arch=None) -> AttentionPlan:
    """Plan attention of ``q`` over ``kv``; only the shapes of the index arrays are used (dense K/V:
    ``block_tables`` None and ``seq_lens`` = cu_seqlens_k). ``kv_split_size``: None chooses from the
    shape, 0 never splits, n splits every n keys; ``max_splits`` fixes the partial depth (vLLM v2).
    ``min_query_len``: a hint that every query run is at least this long; past PD_MAX_Q = 16 the prefill kernel takes
    every run and no decode kernel is launched (a hint that overstates costs speed, not results); ``prior_state`` (cascade): every split writes partials and the merge folds in run_attention's
    ``prior_lse`` state, whose output is ``out``. ``arch``: the architecture whose kernels the plan takes (None: the
    device's; "sm_80", "sm_90", ...): on sm_90 long query runs take the Hopper prefill kernel, elsewhere the mma.sync
    one; run_attention runs a plan of either on the sim.
    Every argument is checked (shapes, dtypes, hints; never the contents); planning a batch shape seen before
    then costs a dictionary lookup."""
    _check_plan_arrays(q, kv, block_tables, seq_lens, query_start_loc)
    return plan_checked(q, kv, block_tables, seq_lens, query_start_loc,
                        max_query_len=check_optional_int("max_query_len", max_query_len, 0),
                        max_seq_len=check_optional_int("max_seq_len", max_seq_len, 0),
                        kv_split_size=check_optional_int("kv_split_size", kv_split_size, 0),
                        max_splits=check_optional_int("max_splits", max_splits, 1),
                        always_partials=check_bool("always_partials", always_partials, strict=True),
                        min_query_len=check_optional_int("min_query_len", min_query_len, 0),
                        prior_state=check_bool("prior_state", prior_state, strict=True),
                        arch=None if arch is None else check_arch("arch", arch))


def plan_checked(q, kv: KvView, block_tables, seq_lens, query_start_loc=None, *, max_query_len=None, max_seq_len=None,
                 kv_split_size=None, max_splits=None, always_partials=False, min_query_len=None,
                 prior_state=False, arch=None) -> AttentionPlan:
    """plan_attention of arguments the caller has checked with the same checks (the ops: validate, plan, run)."""
    xp = module_of(q)
    return make_plan(PlanKey(tuple(q.shape), np.dtype(q.dtype), kv.kind, kv.kv_cache_dtype, kv.num_kv_heads,
                             kv.v_head_size, kv.block_size, None if block_tables is None else block_tables.shape[1],
                             seq_lens.shape[0], query_start_loc is None, max_query_len, max_seq_len, kv_split_size,
                             max_splits, always_partials, sm_count(xp), sm_shared_bytes(xp), kv.decode_layout,
                             kv.prefill_rows, min_query_len, prior_state, arch or device_arch(xp)))


def _check_kv(kv) -> None:
    if not isinstance(kv, KvView):
        raise TypeError(f"kv must be a KvView (KvView.paged, .dense or .mla), got {type(kv).__name__}")


def _check_plan_arrays(q, kv, block_tables, seq_lens, query_start_loc) -> None:
    """q against kv (head size, dtype, GQA heads) and the index arrays' shapes and dtypes."""
    _check_kv(kv)
    num_tokens, num_heads, head_size = check_q(q, max_head_size=MLA_BUCKET[0] if kv.kind == "mla" else MAX_HEAD_SIZE)
    if head_size != kv.head_size:
        raise ValueError(f"q's head size {head_size} must equal kv's {kv.head_size}")
    if kv.kv_cache_dtype == "auto" and q.dtype != kv.key.dtype:
        raise TypeError(f"q must have dtype {kv.key.dtype} (kv's), got {q.dtype}")
    check_heads(num_heads, kv.num_kv_heads, "q", "kv")
    check_tables(block_tables, seq_lens, query_start_loc, num_tokens, dense=kv.kind == "dense")


def window_bounds(causal, sliding_window=None, window_size=None) -> tuple[int, int]:
    """(window_left, window_right) of PaParams: a query at position p sees keys p - left .. p + right (-1: no bound).
    ``sliding_window`` W: the W most recent keys, left W - 1; ``window_size``: FlashAttention's (left, right);
    causal caps the right side at 0 (FlashAttention too)."""
    left, right = window_size if window_size is not None else (-1, -1)
    if sliding_window:
        left = sliding_window - 1
    return int(left), 0 if causal else int(right)


def check_fits(plan: AttentionPlan, limit: int, device: str = "this GPU") -> None:
    """The plan's dynamic shared memory against the device's opt-in limit per block: a clear error
    before the launch (MLA's 576/512 tiles need ~113 KB; sm_86 / sm_89 allow 99 KB)."""
    for launch in plan.launches:
        if launch.shared_mem > limit:
            raise NotImplementedError(
                f"{launch.kernel} needs {launch.shared_mem} bytes of shared memory per block; {device} allows {limit} "
                f"(sm_80: 163 KB, sm_86/sm_89: 99 KB, sm_90: 227 KB): use a GPU with more shared memory per block")


_OPTED_IN: dict = {}  # id(kernel) -> (kernel, bytes): the dynamic shared memory it was opted in for


def _kernel(plan: AttentionPlan, launch: Launch, xp):
    """One of the plan's main kernels, opted in for its shared memory once (the attribute is a driver
    call on a GPU), after checking that the device can give it."""
    kernel = family_of(launch.kernel).function(launch.kernel, xp)
    opted = _OPTED_IN.get(id(kernel))
    if opted is None or opted[1] < launch.shared_mem:
        if not on_sim(xp):
            check_fits(plan, *device_shared_limit(xp))
        kernel.max_dynamic_shared_size_bytes = launch.shared_mem
        _OPTED_IN[id(kernel)] = (kernel, launch.shared_mem)
    return kernel


def _block_shift(block_size: int) -> int:
    """log2(block_size) for a power of two (the decode kernel shifts), else -1 (it divides)."""
    n = int(block_size)
    return n.bit_length() - 1 if n & (n - 1) == 0 else -1


def _check_run(plan: AttentionPlan, q, kv: KvView, out, lse, partials) -> None:
    """run_attention's checks, cheap enough for every call: the plan, q and kv against it, and the buffers it writes
    (shape, dtype, contiguity, writable)."""
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan (from plan_attention), got {type(plan).__name__}")
    _check_kv(kv)
    want = (plan.num_tokens, plan.num_heads, plan.head_size, plan.dtype, plan.num_kv_heads, plan.v_head_size, plan.kv)
    try:
        got = (*q.shape, CTYPE.get(q.dtype), kv.num_kv_heads, kv.v_head_size, kv.key_id)
    except AttributeError:
        raise TypeError(f"q must be a numpy or cupy array, got {type(q).__name__}") from None
    if want != got:
        raise ValueError(f"run_attention: q / kv do not match the plan (plan: {want}, got: {got})")
    if plan.tiles and not kv.prefill_rows:  # the plan launches paged_prefill_kernel
        raise ValueError("run_attention: the plan's prefill kernel reads K and V rows; this kv's values are not rows "
                         "(vLLM's layout): plan with this kv")
    if kv.decode_layout != plan.decode_layout:
        raise ValueError(f"run_attention: the plan's decode kernel reads K/V laid out as {plan.decode_layout!r}; "
                         f"this kv's are {kv.decode_layout!r}: plan with this kv")
    check_last_contiguous("q", q)
    check_written("out", out, (plan.num_tokens, plan.num_heads, plan.v_head_size), q.dtype)
    if lse is not None:
        check_written("lse", lse, (plan.num_heads, plan.num_tokens), np.float32, contiguous=True)
    if partials is not None and plan.partial_shapes is not None:
        if not isinstance(partials, (tuple, list)) or len(partials) != 3:
            raise TypeError(f"partials must be (max_logits, exp_sums, tmp_output), got {type(partials).__name__}")
        for name, a, shape in zip(("max_logits", "exp_sums", "tmp_output"), partials, plan.partial_shapes):
            in_q_type = name == "tmp_output" and getattr(a, "dtype", None) == q.dtype  # vLLM v2's tmp_output
            check_written(f"partials' {name}", a, shape, q.dtype if in_q_type else np.float32, contiguous=True)


def _check_prior(plan: AttentionPlan, lse, prior_lse, merge: bool, partials, prior_partials) -> None:
    """run_attention's cascade arguments (see there)."""
    if plan.prior_state != (prior_lse is not None or not merge):
        raise ValueError(f"run_attention: prior_lse (or merge=False) goes with a plan made with prior_state=True "
                         f"(this plan's prior_state: {plan.prior_state})")
    if prior_lse is not None:
        check_written("prior_lse", prior_lse, (plan.num_heads, plan.num_tokens), np.float32, contiguous=True)
        if prior_lse is lse or not merge:
            raise ValueError("prior_lse must not be lse (the merge reads one while it writes the other), nor come "
                             "with merge=False")
    if not merge and partials is None:
        raise ValueError("run_attention(merge=False) leaves its partials for a later call: pass partials")
    if prior_partials is not None:
        if plan.prior_state or plan.merge is not None or plan.tiles or len(plan.launches) != 1:
            raise ValueError("prior_partials go to a plan whose one decode kernel does not split (each row folds "
                             "them in as it finishes)")
        if not isinstance(prior_partials, (tuple, list)) or len(prior_partials) != 3:
            raise TypeError(f"prior_partials must be (max_logits, exp_sums, tmp_output), got "
                            f"{type(prior_partials).__name__}")
        rows = (plan.num_tokens, plan.num_heads, getattr(prior_partials[0], "shape", (0, 0, 0))[-1])
        if not 1 <= rows[2] <= kernel_constants()["PA_PRIOR_SPLITS"]:
            raise ValueError(f"prior_partials: 1 to {kernel_constants()['PA_PRIOR_SPLITS']} splits a row, got "
                             f"{rows[2]}")
        for name, a, shape in zip(("max_logits", "exp_sums", "tmp_output"), prior_partials,
                                  (rows, rows, (*rows, plan.v_head_size))):
            check_written(f"prior_partials' {name}", a, shape, np.float32, contiguous=True)


@accepts_foreign_arrays
def run_attention(plan: AttentionPlan, q, kv: KvView, out, lse, block_tables, seq_lens, query_start_loc=None, *,
                  scale=None, causal=True, sliding_window=None, window_size=None, sinks=None, alibi_slopes=None,
                  softcap=None, k_scale=1.0, v_scale=1.0, partials=None, seqused_k=None, custom_mask=None,
                  mask_indptr=None, prior_lse=None, merge=True, prior_partials=None):
    """Launch ``plan`` (its main kernels, then the split merge when it splits); returns ``out``. ``lse``: float32
    ``[num_heads, num_tokens]`` or None; ``partials``: (max_logits, exp_sums, tmp_output) of
    ``plan.partial_shapes`` (allocated when None). Visible keys: ``sliding_window`` W (the W most recent) or
    ``window_size`` (left, right) around a query's position, -1 unbounded, and causal caps the right side at 0;
    ``seqused_k`` (dense K/V): int32 ``[num_seqs]`` keys used of each sequence's rows. ``custom_mask`` /
    ``mask_indptr``: a tree mask, as paged_attention takes it (cupaged/_custom_mask.py; booleans are packed here).
    Cascade's levels (cupaged/cascade.py): ``prior_lse`` float32 ``[num_heads, num_tokens]`` (a plan with
    ``prior_state``; not ``lse``): a state already in ``out``, merged into the result as one more split, the sink
    added once; or ``merge=False`` (a ``prior_state`` plan, ``partials`` given): the main kernels alone, every
    split slot of ``partials`` written for a later call's ``prior_partials`` (a plan whose one decode kernel does
    not split), which its rows fold in before they finish.
    Checked on every call, at a host cost of a few µs: the plan, q and kv against it, out / lse / partials (shape,
    dtype, contiguity, writable), scale and softcap (softmax_scales), causal, the window. The index arrays, sinks,
    alibi_slopes and every array's contents are the caller's: the ops validate them before planning."""
    _check_run(plan, q, kv, out, lse, partials)
    causal = check_bool("causal", causal, strict=True)
    scale, softcap = softmax_scales(scale, softcap, plan.head_size)
    if sliding_window or window_size is not None:
        sliding_window, window_size = check_window(sliding_window, window_size, causal)
    xp = module_of(q)
    _check_prior(plan, lse, prior_lse, check_bool("merge", merge, strict=True), partials, prior_partials)
    check_custom_mask(custom_mask, mask_indptr, plan.num_seqs)
    custom_mask, mask_indptr = packed_custom_mask(custom_mask, mask_indptr, query_start_loc, seq_lens)
    if custom_mask is not None and kv.kind == "mla":
        raise NotImplementedError("custom_mask: MLA's kernel takes no custom mask")
    if kv.kv_cache_dtype == "auto":  # a cache of the data's own type ignores the scales
        k_ptr = v_ptr = None
        ksv = vsv = 1.0
        per_head = 0
    else:
        k_ptr, v_ptr, ksv, vsv, per_head = kv_scale_args(xp, kv.kv_cache_dtype, k_scale, v_scale, kv.num_kv_heads)
    if partials is None and plan.partial_shapes is not None:
        if capturing(xp):  # a buffer freed on return would be reused while the graph still writes it
            raise ValueError(f"workspace (or partials) is required while capturing a CUDA graph: this plan splits "
                             f"the keys into up to {plan.max_splits} parts; pass a uint8 workspace of "
                             f"plan.workspace_bytes = {plan.workspace_bytes} bytes")
        partials = tuple(empty(xp, s, np.float32) for s in plan.partial_shapes)
    max_logits, exp_sums, tmp_output = partials or prior_partials or (None, None, None)
    qs, os_ = element_strides("q", q), element_strides("out", out)
    window = window_bounds(causal, sliding_window, window_size)
    fields = dict(
        q_token_stride=qs[0], q_head_stride=qs[1], out_token_stride=os_[0], out_head_stride=os_[1],
        table_stride=0 if block_tables is None else element_strides("block_tables", block_tables)[0],
        scale=scale, softcap=softcap or 0.0, k_scale_value=ksv, v_scale_value=vsv, scale_per_head=per_head,
        window_left=window[0], window_right=window[1], always_partials=int(plan.always_partials),
        partials_only=int(plan.prior_state),
        prior_splits=0 if prior_partials is None else prior_partials[0].shape[2],
        partials_in_out_type=int(tmp_output is not None and tmp_output.dtype != np.float32),
        num_tokens=plan.num_tokens, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads,
        head_size=plan.head_size, v_head_size=plan.v_head_size, block_size=kv.block_size,
        kv_split_size=plan.kv_split_size, max_splits=plan.max_splits, tiles=plan.tiles, vec_k=int(kv.vec_k),
        vec_v=int(kv.vec_v), decode_tiles=plan.decode_tiles, decode_max_q=plan.decode_max_q,
        block_shift=_block_shift(kv.block_size), **kv.strides)
    p = _packed_params(_params_packer()[1](fields))  # struct PaParams

    def label():
        return (f"b={plan.num_seqs} t={plan.num_tokens} h={plan.num_heads}/{plan.num_kv_heads} d={plan.head_size} "
                f"{kv_dtype_name(kv.kv_cache_dtype, kv.key.dtype)}{' causal' if causal else ''} "
                f"splits={plan.max_splits}")

    def cost():
        dense = block_tables is None
        lens = seq_lens if not dense else np.diff(seq_lens) if seqused_k is None else seqused_k
        q_lens = np.ones(plan.num_seqs, np.int64) if query_start_loc is None else np.diff(query_start_loc)
        return attention_cost(lens, q_lens, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads,
                              head_size=plan.head_size, v_head_size=plan.v_head_size, kv_itemsize=kv.key.itemsize,
                              q_itemsize=q.itemsize, out_itemsize=out.itemsize,
                              block_size=None if dense else kv.block_size, window=window, lse=lse is not None, shared_kv=kv.kind == "mla",
                              query_start_loc=query_start_loc is not None)

    args = (q, kv.key, kv.value, block_tables, seq_lens, query_start_loc, seqused_k, custom_mask, mask_indptr, sinks,
            alibi_slopes, k_ptr, v_ptr, out, lse, max_logits, exp_sums, tmp_output, struct_arg(p, xp))
    with op_range(plan.op, label):
        for i, launch in enumerate(plan.launches):
            with declare_launch(xp, plan.op, label, cost) if i == 0 else _OFF:  # the op's cost, declared once
                if custom_mask is not None:
                    launch = dataclasses.replace(launch, kernel=tree_kernel(launch.kernel))
                _kernel(plan, launch, xp)(launch.grid, launch.block, args, shared_mem=launch.shared_mem)
        if plan.merge is not None and merge:  # sequences with one split were finished above
            FAMILY.function(plan.merge.kernel, xp)(
                plan.merge.grid, plan.merge.block,
                (out, lse, max_logits, exp_sums, tmp_output, seq_lens, np.int32(block_tables is None), query_start_loc,
                 seqused_k, sinks, prior_lse, struct_arg(p, xp), np.int32(plan.num_seqs)))
    return out
