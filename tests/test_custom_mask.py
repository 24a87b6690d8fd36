"""Custom (tree) masks of paged_attention / run_attention (cupaged/_custom_mask.py, kernels_cu/attention/logits.cuh
pa_row_sees) against cupaged.reference's paged_attention, on the sim (and cuda with a GPU): draft trees of depth 1-5
and up to 64 tokens a request, the root being the request's last accepted token, beside plain decode tokens; runs of
up to 16 queries take the decode kernels, longer ones the prefill kernel; packed and unpacked masks, mask_indptr
given or not, splits, GQA, fp8 caches, sinks, ALiBi and softcap. Bad masks are a ValueError before any launch."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import reference
from cupaged.testing import assert_close, paged_kv, tolerance

F16, BF16, F32 = np.float16, ml_dtypes.bfloat16, np.float32


def random_tree(rng, nodes: int, depth: int) -> np.ndarray:
    """Parents of a tree of ``nodes`` nodes (node 0 the root, parent -1), every node after its parent, as deep as
    ``depth`` edges and never deeper."""
    parents, depths = [-1], [0]
    for i in range(1, nodes):
        allowed = [j for j in range(i) if depths[j] < depth]
        p = i - 1 if i <= depth else int(rng.choice(allowed))  # a spine first: the tree reaches its depth
        parents.append(p)
        depths.append(depths[p] + 1)
    return np.array(parents)


def tree_mask(parents: np.ndarray, context: int) -> np.ndarray:
    """[nodes, context + nodes]: node i sees the context, its ancestors and itself."""
    n = len(parents)
    mask = np.zeros((n, context + n), bool)
    mask[:, :context] = True
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, context + j] = True
            j = parents[j]
    return mask


def batch(rng, requests):
    """(q_lens, seq_lens, flattened mask) of requests given as (tree nodes, tree depth, context): a depth of 0 is a
    decode token (one query seeing its whole context)."""
    q_lens, seq_lens, masks = [], [], []
    for nodes, depth, context in requests:
        m = tree_mask(random_tree(rng, nodes, depth), context) if depth else np.ones((1, context + 1), bool)
        q_lens.append(m.shape[0])
        seq_lens.append(m.shape[1])
        masks.append(m.ravel())
    return np.array(q_lens), np.array(seq_lens), np.concatenate(masks)


CASES = [  # (requests, heads, head size, dtype, kv cache dtype, block size, options)
    ([(5, 1, 40), (0, 0, 70), (9, 3, 33), (16, 5, 16)], (8, 2), 64, F16, "auto", 16, {}),
    ([(64, 5, 100), (0, 0, 9), (24, 2, 50)], (8, 2), 64, BF16, "auto", 16, {}),  # the prefill kernel's runs
    ([(12, 4, 61), (40, 3, 0), (3, 1, 130)], (4, 4), 32, F32, "auto", 7, {"sinks": True, "softcap": 20.0}),
    ([(17, 5, 90), (6, 2, 47)], (8, 1), 128, F16, "fp8_e4m3", 32, {"alibi": True}),
    ([(33, 4, 300), (8, 3, 500)], (8, 2), 64, BF16, "auto", 16, {"kv_split_size": 64}),  # split, then merged
]


def _inputs(case, seed=0):
    requests, (heads, kv_heads), head_size, dtype, kv_dtype, block_size, options = case
    rng = np.random.default_rng(seed)
    q_lens, seq_lens, mask = batch(rng, requests)
    kv = paged_kv(seq_lens, block_size=block_size, head_size=head_size, num_kv_heads=kv_heads, dtype=dtype,
                  kv_cache_dtype=kv_dtype, spare_columns=1, rng=rng)
    q = (0.7 * rng.standard_normal((q_lens.sum(), heads, head_size))).astype(dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    opts = dict(kv_cache_dtype=kv_dtype, k_scale=kv.k_scale, v_scale=kv.v_scale,
                softcap=options.get("softcap"),
                sinks=rng.uniform(-1, 2, heads).astype(np.float32) if options.get("sinks") else None,
                alibi_slopes=rng.uniform(0.01, 0.2, heads).astype(np.float32) if options.get("alibi") else None)
    return q, kv, qsl, mask, opts, options.get("kv_split_size")


def _ids(case):
    requests, heads, d, dtype, kvd, bs, options = case
    return "-".join(["_".join(f"{n}n{dp}d{c}" for n, dp, c in requests), np.dtype(dtype).name, kvd, f"d{d}",
                     *options])


@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_tree_masks_match_the_reference(backend, case, packed):
    q, kv, qsl, mask, opts, split = _inputs(case)
    dtype, kv_dtype = case[3], case[4]
    ref_out, ref_lse = reference.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl,
                                                 custom_mask=mask, **opts)
    put = backend.asarray
    given = mask
    indptr = None
    if packed:  # FlashInfer's packed_custom_mask with the byte offsets that go with it
        given, indptr = cupaged.pack_custom_mask(mask, query_start_loc=qsl, seq_lens=kv.seq_lens)
        indptr = put(indptr)
    out, lse = cupaged.paged_attention(
        put(q), put(kv.key_cache), put(kv.value_cache), put(kv.block_tables), put(kv.seq_lens), put(qsl),
        custom_mask=put(given), mask_indptr=indptr, kv_split_size=split, return_lse=True, validate=True,
        **{k: put(v) if isinstance(v, np.ndarray) else v for k, v in opts.items()})
    assert_close(backend.to_numpy(out), ref_out, tolerance(dtype, kv_dtype), "out")
    assert_close(backend.to_numpy(lse), ref_lse, "lse", "lse")


def test_a_chain_is_causal_and_the_mask_takes_nothing_else(backend):
    """A chain's mask is the causal mask: the outputs are paged_attention's without a mask, bit for bit (the
    same kernels and order; only the selection differs, and it selects the same keys)."""
    case = ([(20, 20, 35), (7, 7, 12)], (8, 2), 64, F16, "auto", 16, {})
    q, kv, qsl, mask, opts, _ = _inputs(case, seed=3)
    put = backend.asarray
    args = [put(a) for a in (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl)]
    plain = backend.to_numpy(cupaged.paged_attention(*args))
    masked = backend.to_numpy(cupaged.paged_attention(*args, custom_mask=put(mask)))
    assert np.array_equal(plain.view(np.uint16), masked.view(np.uint16))


def test_run_attention_takes_the_mask_of_a_plan_made_without_one(backend):
    case = ([(10, 3, 20), (0, 0, 30)], (8, 2), 64, F16, "auto", 16, {})
    q, kv, qsl, mask, _, _ = _inputs(case, seed=4)
    put = backend.asarray
    view = cupaged.KvView.paged(put(kv.key_cache), put(kv.value_cache), put(q))
    args = [put(a) for a in (kv.block_tables, kv.seq_lens, qsl)]
    plan = cupaged.plan_attention(put(q), view, *args)
    out = backend.empty(q.shape, q.dtype)
    cupaged.run_attention(plan, put(q), view, out, None, *args, custom_mask=put(mask))
    ref, _ = reference.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl,
                                       custom_mask=mask)
    assert_close(backend.to_numpy(out), ref, F16, "out")


def test_pack_custom_mask_is_flashinfer_segment_packbits():
    rng = np.random.default_rng(5)
    lengths = [13, 0, 8, 1, 30]
    segments = [rng.random(n) < 0.5 for n in lengths]
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    packed, packed_indptr = cupaged.pack_custom_mask(np.concatenate(segments), indptr)
    want = [np.packbits(s, bitorder="little") for s in segments]
    assert packed_indptr.tolist() == np.concatenate([[0], np.cumsum([w.size for w in want])]).tolist()
    for s, w in enumerate(want):
        assert np.array_equal(packed[packed_indptr[s]:packed_indptr[s + 1]], w), s


def _bad_masks(mask, qsl, seq_lens):
    q_lens = np.diff(qsl)
    yield dict(custom_mask=mask[:-1]), ValueError, \
        r"custom_mask \(as booleans\) has 218 entries; the requests' .* take 219"
    yield dict(custom_mask=np.concatenate([mask, mask[:3]])), ValueError, "has 222 entries"
    later = mask.copy()
    later[0 * seq_lens[0] + seq_lens[0] - q_lens[0] + 1] = True  # query 0 of request 0 sees the key after its own
    yield dict(custom_mask=later), ValueError, r"request 0's query 0 \(key index \d+\) sees key \d+, a later one"
    yield dict(custom_mask=mask.astype(np.int32)), TypeError, "custom_mask must have dtype"
    yield dict(custom_mask=mask.reshape(1, -1)), ValueError, "custom_mask must be"
    yield dict(custom_mask=None, mask_indptr=np.zeros(4, np.int32)), ValueError, \
        "mask_indptr gives custom_mask's offsets"
    yield dict(custom_mask=mask, mask_indptr=np.zeros(2, np.int32)), ValueError, "mask_indptr must have num_seqs"
    packed, indptr = cupaged.pack_custom_mask(mask, query_start_loc=qsl, seq_lens=seq_lens)
    yield dict(custom_mask=packed[:-1], mask_indptr=indptr), ValueError, r"custom_mask \(bit-packed\) has \d+ bytes"
    shifted = indptr.copy()
    shifted[1] += 1
    yield dict(custom_mask=packed, mask_indptr=shifted), ValueError, "request 0's mask must hold"


def test_bad_masks_are_named_before_any_launch():
    case = ([(6, 2, 10), (0, 0, 5), (9, 3, 4)], (8, 2), 64, F16, "auto", 16, {})
    q, kv, qsl, mask, _, _ = _inputs(case, seed=6)
    out = np.full(q.shape, 7, F16)
    for change, exc, match in _bad_masks(mask, qsl, kv.seq_lens):
        given = {"custom_mask": mask, **change}
        with pytest.raises(exc, match=match):
            cupaged.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, out=out,
                                    **given)
        assert (out == 7).all(), change  # nothing written
    cupaged.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, out=out,
                            custom_mask=mask)
    assert not (out == 7).any()
