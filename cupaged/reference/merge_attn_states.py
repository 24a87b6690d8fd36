"""Reference of merge_attn_states (kernels_cu/merge_attn_states.cu): two partial attention states
combined by their LSEs."""

from __future__ import annotations

import numpy as np


def merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse, prefill_tokens_with_context=None):
    """vLLM's merge of two partial attention states (outputs [num_tokens, num_heads, head_size],
    LSEs [num_heads, num_tokens]) -> (output float64, output_lse float64). A +inf LSE counts as -inf;
    both sides -inf: the prefix output and -inf; tokens at or past prefill_tokens_with_context take
    the suffix verbatim."""
    po, so = np.asarray(prefix_output, np.float64), np.asarray(suffix_output, np.float64)
    pl, sl = np.asarray(prefix_lse, np.float64).T, np.asarray(suffix_lse, np.float64).T  # [tokens, heads]
    pl = np.where(np.isposinf(pl), -np.inf, pl)
    sl = np.where(np.isposinf(sl), -np.inf, sl)
    mx = np.maximum(pl, sl)
    both_empty = np.isneginf(mx)
    mx_safe = np.where(both_empty, 0.0, mx)
    pw, sw = np.exp(pl - mx_safe), np.exp(sl - mx_safe)
    total = np.where(both_empty, 1.0, pw + sw)
    out = (po * (pw / total)[..., None] + so * (sw / total)[..., None])
    out = np.where(both_empty[..., None], po, out)
    lse = np.where(both_empty, -np.inf, mx_safe + np.log(total))
    n = po.shape[0] if prefill_tokens_with_context is None else int(prefill_tokens_with_context)
    out[n:], lse[n:] = so[n:], np.asarray(suffix_lse, np.float64).T[n:]
    return out, lse.T
