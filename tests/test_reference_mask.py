"""cupaged.reference.attention's FlashInfer-style custom (tree) masks: numpy only, no kernels."""

from __future__ import annotations

import numpy as np
import pytest

from cupaged.reference.attention import paged_attention, unpack_custom_mask

HEADS, KV_HEADS, D, BS = 4, 2, 16, 4


def _paged(ks, vs, rng):
    """NHD caches holding each sequence's dense K/V [L, KV_HEADS, D] in shuffled blocks, plus the block table."""
    nblocks = [-(-len(k) // BS) for k in ks]
    ids = rng.permutation(sum(nblocks) + 3)
    kc = np.full((len(ids), BS, KV_HEADS, D), np.nan)
    vc = np.full_like(kc, np.nan)
    table = np.full((len(ks), max(nblocks)), 10_000, np.int32)
    at = 0
    for s, (k, v) in enumerate(zip(ks, vs)):
        for b in range(nblocks[s]):
            blk = ids[at]
            at += 1
            table[s, b] = blk
            n = min(BS, len(k) - b * BS)
            kc[blk, :n], vc[blk, :n] = k[b * BS:b * BS + n], v[b * BS:b * BS + n]
    return kc, vc, table


def _problem(rng, shapes):
    """(q, kc, vc, table, seq_lens, qsl) for (q_len, kv_len) per request."""
    ks = [rng.standard_normal((kv, KV_HEADS, D)) for _, kv in shapes]
    vs = [rng.standard_normal((kv, KV_HEADS, D)) for _, kv in shapes]
    kc, vc, table = _paged(ks, vs, rng)
    qsl = np.concatenate([[0], np.cumsum([ql for ql, _ in shapes])]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], HEADS, D))
    return q, kc, vc, table, np.array([kv for _, kv in shapes], np.int32), qsl


SHAPES = ((3, 7), (1, 5), (6, 6), (5, 13))


def _flat(masks):
    return np.concatenate([m.reshape(-1) for m in masks])


def _pack(masks):
    """Little-endian, each request's bits starting on a byte (written bit by bit, not with np.packbits)."""
    out = []
    for m in masks:
        flat = m.reshape(-1)
        seg = np.zeros(-(-flat.size // 8), np.uint8)
        for e, bit in enumerate(flat):
            if bit:
                seg[e // 8] |= np.uint8(1 << (e % 8))
        out.append(seg)
    return np.concatenate(out)


def _random_masks(rng, shapes):
    return [rng.random((ql, kv)) < 0.6 for ql, kv in shapes]


def test_all_true_mask_equals_non_causal():
    rng = np.random.default_rng(0)
    q, kc, vc, table, seq_lens, qsl = _problem(rng, SHAPES)
    masks = [np.ones((ql, kv), bool) for ql, kv in SHAPES]
    want = paged_attention(q, kc, vc, table, seq_lens, qsl, causal=False)
    for cm in (_flat(masks), _pack(masks)):
        got = paged_attention(q, kc, vc, table, seq_lens, qsl, causal=False, custom_mask=cm)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-12)


def test_bottom_right_lower_triangle_equals_causal():
    rng = np.random.default_rng(1)
    q, kc, vc, table, seq_lens, qsl = _problem(rng, SHAPES)
    masks = [np.array([[j <= kv - ql + i for j in range(kv)] for i in range(ql)]) for ql, kv in SHAPES]
    want = paged_attention(q, kc, vc, table, seq_lens, qsl, causal=True)
    got = paged_attention(q, kc, vc, table, seq_lens, qsl, causal=False, custom_mask=_flat(masks))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-12)
    # AND-ed with causal: the same triangle changes nothing
    again = paged_attention(q, kc, vc, table, seq_lens, qsl, causal=True, custom_mask=_pack(masks))
    np.testing.assert_allclose(again[0], want[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_tree_mask_equals_each_path_alone(causal):
    rng = np.random.default_rng(2)
    ctx = 9
    parents = [-1, 0, 0, 1, 1, 2, 3, 5, -1, 8]  # two trees; a parent precedes its children
    n = len(parents)

    def path(i):
        p = []
        while i >= 0:
            p.append(i)
            i = parents[i]
        return p[::-1]

    k_ctx, v_ctx = rng.standard_normal((ctx, KV_HEADS, D)), rng.standard_normal((ctx, KV_HEADS, D))
    k_tree, v_tree = rng.standard_normal((n, KV_HEADS, D)), rng.standard_normal((n, KV_HEADS, D))
    q = rng.standard_normal((n, HEADS, D))

    # the tree: one request, its n nodes the queries and the last n keys
    kc, vc, table = _paged([np.concatenate([k_ctx, k_tree])], [np.concatenate([v_ctx, v_tree])], rng)
    mask = np.zeros((n, ctx + n), bool)
    mask[:, :ctx] = True
    for i in range(n):
        for a in path(i):
            mask[i, ctx + a] = True
    seq_lens, qsl = np.array([ctx + n]), np.array([0, n])
    got_out, got_lse = paged_attention(q, kc, vc, table, seq_lens, qsl, causal=causal, custom_mask=mask.reshape(-1))

    # each root-to-node path its own decode request: context then the path's nodes, plain causal
    ks = [np.concatenate([k_ctx, k_tree[path(i)]]) for i in range(n)]
    vs = [np.concatenate([v_ctx, v_tree[path(i)]]) for i in range(n)]
    kc2, vc2, table2 = _paged(ks, vs, rng)
    want_out, want_lse = paged_attention(q, kc2, vc2, table2, np.array([len(k) for k in ks]), causal=True)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-12, atol=1e-12)


def test_packed_equals_unpacked_and_indptr_none_equals_explicit():
    rng = np.random.default_rng(3)
    q, kc, vc, table, seq_lens, qsl = _problem(rng, SHAPES)
    masks = _random_masks(rng, SHAPES)
    masks[2][4] = False  # one row sees nothing
    flat, packed = _flat(masks), _pack(masks)
    sizes = [ql * kv for ql, kv in SHAPES]
    ind_bool = np.concatenate([[0], np.cumsum(sizes)])
    ind_bytes = np.concatenate([[0], np.cumsum([-(-s // 8) for s in sizes])])
    assert packed.size == ind_bytes[-1] and any(s % 8 for s in sizes)
    for m, u in zip(masks, unpack_custom_mask(packed, None, [ql for ql, _ in SHAPES], seq_lens)):
        np.testing.assert_array_equal(m, u)

    common = dict(causal=False, sinks=None)
    ref = paged_attention(q, kc, vc, table, seq_lens, qsl, custom_mask=flat, **common)
    runs = [paged_attention(q, kc, vc, table, seq_lens, qsl, custom_mask=flat, mask_indptr=ind_bool, **common),
            paged_attention(q, kc, vc, table, seq_lens, qsl, custom_mask=packed, **common),
            paged_attention(q, kc, vc, table, seq_lens, qsl, custom_mask=packed, mask_indptr=ind_bytes, **common)]
    # segments with gaps between them: only the indptr locates them
    gap = 3
    gapped_bool = np.concatenate([np.concatenate([np.ones(gap, bool), m.reshape(-1)]) for m in masks])
    gapped_bytes = np.concatenate([np.concatenate([np.full(gap, 0xFF, np.uint8), p])
                                   for p in (_pack([m]) for m in masks)])
    starts_b = np.cumsum([0] + [gap + s for s in sizes])
    ind_gb = np.r_[starts_b[:-1] + gap, starts_b[-1]]
    starts_y = np.cumsum([0] + [gap + -(-s // 8) for s in sizes])
    ind_gy = np.r_[starts_y[:-1] + gap, starts_y[-1]]
    for i in range(len(sizes)):  # segment i is [ind[i], ind[i+1]); trailing gap bytes belong to it, harmlessly
        assert (gapped_bool[ind_gb[i]:ind_gb[i] + sizes[i]] == masks[i].reshape(-1)).all()
    runs.append(paged_attention(q, kc, vc, table, seq_lens, qsl, custom_mask=gapped_bool, mask_indptr=ind_gb,
                                **common))
    runs.append(paged_attention(q, kc, vc, table, seq_lens, qsl, custom_mask=gapped_bytes, mask_indptr=ind_gy,
                                **common))
    for out, lse in runs:
        np.testing.assert_array_equal(out, ref[0])
        np.testing.assert_array_equal(lse, ref[1])
    t = qsl[2] + 4
    assert (ref[0][t] == 0).all() and np.isneginf(ref[1][:, t]).all()
    # the mask matters: differs from no mask
    assert not np.allclose(ref[0], paged_attention(q, kc, vc, table, seq_lens, qsl, causal=False)[0])


def test_decode_mask_drops_keys():
    rng = np.random.default_rng(4)
    shapes = ((1, 11), (1, 6))
    q, kc, vc, table, seq_lens, _ = _problem(rng, shapes)
    masks = [np.ones((1, 11), bool), np.ones((1, 6), bool)]
    masks[0][0, [0, 4, 10]] = False
    got = paged_attention(q, kc, vc, table, seq_lens, custom_mask=_pack(masks))
    # dropping the masked keys from request 0's sequence instead
    keep = np.flatnonzero(masks[0][0])
    k0 = np.stack([kc[table[0, j // BS], j % BS] for j in keep])
    v0 = np.stack([vc[table[0, j // BS], j % BS] for j in keep])
    kc2, vc2, table2 = _paged([k0], [v0], rng)
    want = paged_attention(q[:1], kc2, vc2, table2, np.array([len(keep)]))
    np.testing.assert_allclose(got[0][:1], want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1][:, :1], want[1], rtol=1e-12, atol=1e-12)
    plain = paged_attention(q, kc, vc, table, seq_lens)
    np.testing.assert_array_equal(got[0][1:], plain[0][1:])
