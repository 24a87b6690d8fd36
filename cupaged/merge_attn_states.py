"""Merge of two partial attention states (kernels_cu/merge_attn_states.cu), vLLM's ``merge_attn_states``.

Two attention results over disjoint key sets of the same queries (a cached prefix and the new
suffix in chunked prefill, or two KV splits) combine exactly through their log-sum-exps:
``output = w_p * prefix_output + w_s * suffix_output`` with ``w_p = e^{p} / (e^{p} + e^{s})``, and
``output_lse = log(e^{p} + e^{s})``. The reference is :func:`cupaged.reference.merge_attn_states`.
"""

from __future__ import annotations

import numbers

import numpy as np

from cupaged._interop import accepts_foreign_arrays
from cupaged._annotate import op_launch
from cupaged._checks import CTYPE, FLOAT_DTYPES, address, check_dtype, check_last_contiguous, check_ndim, \
    check_writable, element_strides
from cupaged._backend import array_module
from cupaged._cost import Cost
from cupaged._mirror import constants
from cupaged._runtime import KernelFamily

__all__ = ["merge_attn_states"]



def _kernel(ctype: str, vec: bool) -> str:
    return f"cupaged::merge_attn_states_kernel<{ctype}, {'true' if vec else 'false'}>"


FAMILY = KernelFamily("merge_attn_states", [_kernel(CTYPE[d], v) for d in FLOAT_DTYPES for v in (False, True)])


def _check_output(name, a, shape, dtype):
    check_ndim(name, a, 3, "[num_tokens, num_heads, head_size]")
    if dtype is not None and a.dtype != dtype:
        raise TypeError(f"{name} must have output's dtype {dtype}, got {a.dtype}")
    if shape is not None and tuple(a.shape) != shape:
        raise ValueError(f"{name} must have output's shape {shape} [num_tokens, num_heads, head_size], "
                         f"got {tuple(a.shape)}")
    if a.size:  # numpy may give an empty array zero strides
        check_last_contiguous(name, a)


def _check_lse(name, a, num_heads, num_tokens):
    check_dtype(name, a, (np.float32,))
    if tuple(a.shape) != (num_heads, num_tokens):
        hint = " (that is [num_tokens, num_heads]: transpose it)" if tuple(a.shape) == (num_tokens, num_heads) else ""
        raise ValueError(f"{name} must be float32 [num_heads, num_tokens] = [{num_heads}, {num_tokens}] "
                         f"(natural-log LSE, vLLM / FlashAttention layout), got shape {tuple(a.shape)}{hint}")


def _span(a, start):
    """[lo, hi) bytes an array's elements can touch, its first element at ``start``; None when empty."""
    if a.size == 0:
        return None
    lo = hi = start
    for n, s in zip(a.shape, a.strides):
        if s < 0:
            lo += s * (n - 1)
        else:
            hi += s * (n - 1)
    return lo, hi + a.itemsize


def _check_no_overlap(arrays, in_place) -> dict:
    """Written arrays must not share memory with any other argument, except as the very same view
    of one input (merging in place, which the kernel supports). Returns each given array's address:
    each is read once (a numpy address builds the __array_interface__ dict), the spans compared as
    intervals."""
    written = ("output", "output_lse")
    where = {n: address(a) for n, a in arrays.items() if a is not None}
    spans = {n: _span(arrays[n], start) for n, start in where.items()}
    names = list(where)
    for i, name in enumerate(names):
        for other in names[i + 1:]:
            if name not in written and other not in written:
                continue
            sa, sb = spans[name], spans[other]
            if sa is None or sb is None or sa[0] >= sb[1] or sb[0] >= sa[1]:
                continue
            a, b = arrays[name], arrays[other]
            if (name, other) in in_place and where[name] == where[other] and a.shape == b.shape and \
                    a.strides == b.strides and a.dtype == b.dtype:
                continue
            raise ValueError(f"{name} overlaps {other} in memory: pass separate buffers, or to merge in place "
                             f"pass the very same array (output as prefix_output or suffix_output, output_lse "
                             f"as prefix_lse or suffix_lse)")
    return where


@accepts_foreign_arrays
def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                      prefill_tokens_with_context=None):
    """vLLM's ``merge_attn_states``: write the merge of two partial attention states into ``output``.

    ``prefix_output``, ``suffix_output``, ``output``: ``[num_tokens, num_heads, head_size]``, all
    float32, float16 or bfloat16 (one dtype), ``head_size`` a multiple of 8; token and head strides
    are free (views of fused or head-padded buffers), the last dimension contiguous.
    ``prefix_lse``, ``suffix_lse``, ``output_lse``: float32 ``[num_heads, num_tokens]``, natural log,
    any strides. The merge runs in float32.

    A +inf LSE (FlashAttention 2's empty row) counts as -inf. Where both LSEs are -inf the prefix
    output is copied and the output LSE is -inf (never NaN). Tokens at or past
    ``prefill_tokens_with_context`` (an int in ``[0, num_tokens]``; None: every token merges) have
    no prefix: they take the suffix output and suffix LSE as stored. ``output_lse`` is written when
    given. ``output`` may be ``prefix_output`` or ``suffix_output`` itself (and ``output_lse`` one
    of the input LSEs) to merge in place; any other overlap is a ``ValueError``. Returns None.
    """
    arrays = dict(output=output, output_lse=output_lse, prefix_output=prefix_output, prefix_lse=prefix_lse,
                  suffix_output=suffix_output, suffix_lse=suffix_lse)
    xp = array_module(**arrays)
    _check_output("output", output, None, None)
    check_dtype("output", output, FLOAT_DTYPES)
    shape = tuple(output.shape)
    num_tokens, num_heads, head_size = shape
    _check_output("prefix_output", prefix_output, shape, output.dtype)
    _check_output("suffix_output", suffix_output, shape, output.dtype)
    if head_size % 8:
        raise ValueError(f"head_size (the outputs' last dimension) must be a multiple of 8, got {head_size}")
    _check_lse("prefix_lse", prefix_lse, num_heads, num_tokens)
    _check_lse("suffix_lse", suffix_lse, num_heads, num_tokens)
    if output_lse is not None:
        _check_lse("output_lse", output_lse, num_heads, num_tokens)
    if prefill_tokens_with_context is None:
        prefill_tokens_with_context = num_tokens
    elif not isinstance(prefill_tokens_with_context, numbers.Integral) or isinstance(prefill_tokens_with_context,
                                                                                      (bool, np.bool_)):
        raise TypeError(f"prefill_tokens_with_context must be an int or None, got "
                        f"{type(prefill_tokens_with_context).__name__}")
    elif not 0 <= prefill_tokens_with_context <= num_tokens:
        raise ValueError(f"prefill_tokens_with_context must be in [0, num_tokens={num_tokens}], got "
                         f"{prefill_tokens_with_context}")
    check_writable("output", output)
    check_writable("output_lse", output_lse)
    where = _check_no_overlap(arrays, {("output", "prefix_output"), ("output", "suffix_output"),
                                       ("output_lse", "prefix_lse"), ("output_lse", "suffix_lse")})
    rows = num_tokens * num_heads
    if rows >= 2**31:
        raise NotImplementedError(f"output: num_tokens * num_heads must be below 2^31, got {rows}")
    strides = [*element_strides("output", output)[:2], *element_strides("prefix_output", prefix_output)[:2],
               *element_strides("suffix_output", suffix_output)[:2]]
    lse_strides = [*(element_strides("output_lse", output_lse) if output_lse is not None else (0, 0)),
                   *element_strides("prefix_lse", prefix_lse), *element_strides("suffix_lse", suffix_lse)]
    if rows == 0 or head_size == 0:
        return None
    pack = 16 // output.itemsize
    vec = all(where[n] % 16 == 0 for n in ("output", "prefix_output", "suffix_output")) and \
        all(s % pack == 0 for s in strides)
    threads = constants(FAMILY.source, "MERGE_THREADS")["MERGE_THREADS"]  # per CTA, the kernel's __launch_bounds__
    threads_per_row = min(head_size // pack, threads)
    rows_per_cta = threads // threads_per_row
    kernel = FAMILY.function(_kernel(CTYPE[output.dtype], vec), xp)

    def cost():  # both partial outputs and LSEs read, the output (and its LSE) written: a pure stream
        lse_out = 0 if output_lse is None else rows * 4
        return Cost(3 * rows * head_size * output.itemsize + 2 * rows * 4 + lse_out, 0)

    with op_launch(xp, "merge_attn_states", lambda: f"t={num_tokens} h={num_heads} d={head_size} {output.dtype}",
                   cost):
        kernel((-(-rows // rows_per_cta),), (threads_per_row, rows_per_cta),
               (output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse,
                *np.array(strides + lse_strides, np.int64),  # one conversion, not twelve np.int64 calls
                *np.array((num_tokens, num_heads, head_size, prefill_tokens_with_context), np.int32)))
    return None
