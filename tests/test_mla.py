"""MLA decode over the latent paged cache against cupaged.reference.mla_decode."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import reference
from cupaged.testing import assert_close, paged_kv, tolerance

RANK, ROPE = 512, 64


def latent_pool(rng, seq_lens, block_size, dtype, kv_cache_dtype):
    """A NaN/0xFF-poisoned latent cache with each sequence's rows, its shuffled block table
    (garbage past the end) and the fp8 scale (cupaged.testing.paged_kv)."""
    kv = paged_kv(seq_lens, block_size=block_size, head_size=RANK + ROPE, dtype=dtype, layout="mla",
                  kv_cache_dtype=kv_cache_dtype, spare_blocks=5, spare_columns=2, rng=rng)
    return kv.key_cache, kv.block_tables, kv.k_scale


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("num_heads, block_size, seq_lens, split", [
    (16, 16, [1, 17, 600, 2048], None),
    (128, 64, [1, 65, 300], 128),
    (16, 64, [0, 64, 1000], 256),
    (128, 16, [40, 2], None),
], ids=["h16-bs16", "h128-bs64-split128", "h16-bs64-empty", "h128-bs16"])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["f16", "bf16"])
def test_mla_decode(backend, kv_cache_dtype, num_heads, block_size, seq_lens, split, dtype):
    rng = np.random.default_rng(num_heads + block_size)
    cache, table, scale = latent_pool(rng, seq_lens, block_size, dtype, kv_cache_dtype)
    lens = np.array(seq_lens, np.int32)
    q = (rng.standard_normal((len(lens), num_heads, RANK + ROPE)) * 0.5).astype(dtype)
    out, lse = cupaged.mla_decode(*(backend.asarray(a) for a in (q, cache, table, lens)), scale=0.05,
                                  kv_cache_dtype=kv_cache_dtype, k_scale=scale, kv_split_size=split, return_lse=True)
    ref_out, ref_lse = reference.mla_decode(q, cache, table, lens, scale=0.05, kv_cache_dtype=kv_cache_dtype,
                                            k_scale=scale)
    assert_close(backend.to_numpy(out), ref_out, tolerance(dtype, kv_cache_dtype), "out")
    assert_close(backend.to_numpy(lse), ref_lse, "lse", "lse")


def test_mla_decode_split_partials_in_a_workspace(backend):
    """workspace= holds the split partials (as a captured decode step needs): the same bits as without."""
    rng = np.random.default_rng(8)
    cache, table, _ = latent_pool(rng, [300, 7], 16, np.float16, "auto")
    args = [backend.asarray(a) for a in (rng.standard_normal((2, 16, RANK + ROPE)).astype(np.float16), cache, table,
                                         np.array([300, 7], np.int32))]
    plan = cupaged.plan_attention(args[0], cupaged.KvView.mla(args[1], RANK), args[2], args[3], kv_split_size=64)
    workspace = backend.asarray(np.full(plan.workspace_bytes + 5, 0xFF, np.uint8))[5:]  # unaligned on purpose
    got = cupaged.mla_decode(*args, scale=0.05, kv_split_size=64, workspace=workspace)
    want = cupaged.mla_decode(*args, scale=0.05, kv_split_size=64)
    assert plan.max_splits > 1 and np.array_equal(backend.to_numpy(got).view(np.uint16),
                                                   backend.to_numpy(want).view(np.uint16))


def test_mla_decode_split_is_batch_invariant(backend):
    rng = np.random.default_rng(5)
    cache, table, _ = latent_pool(rng, [900, 40, 1500], 16, np.float16, "auto")
    q = rng.standard_normal((3, 16, RANK + ROPE)).astype(np.float16)
    lens = np.array([900, 40, 1500], np.int32)
    full = cupaged.mla_decode(*(backend.asarray(a) for a in (q, cache, table, lens)), scale=0.05, kv_split_size=256)
    alone = cupaged.mla_decode(*(backend.asarray(a) for a in (q[:1], cache, table[:1], lens[:1])), scale=0.05,
                               kv_split_size=256)
    assert np.array_equal(backend.to_numpy(full)[0].view(np.uint16), backend.to_numpy(alone)[0].view(np.uint16))


BAD = {
    "cache dtype": (lambda a: {"kv_cache": a["kv_cache"].astype(np.float32)}, TypeError, "kv_cache"),
    "cache width": (lambda a: {"kv_cache": a["kv_cache"][..., :500]}, ValueError, "kv_cache"),
    "rank past the row": (lambda a: {"kv_lora_rank": 600}, ValueError, "kv_lora_rank=600 exceeds"),
    "rank too big": (lambda a: {"q": np.zeros((2, 16, 640), np.float16), "kv_cache": np.zeros((4, 16, 640), np.float16),
                                "kv_lora_rank": 576}, NotImplementedError, "kv_lora_rank"),
    "rank default on a small row": (lambda a: {"q": a["q"][..., :320], "kv_cache": a["kv_cache"][..., :320]},
                                    ValueError, "kv_lora_rank=512 exceeds.*kv_lora_rank=256"),
    "tables dtype": (lambda a: {"block_tables": a["block_tables"].astype(np.int64)}, TypeError, "block_tables"),
    "seq_lens rows": (lambda a: {"seq_lens": a["seq_lens"][:1]}, ValueError, "block_tables"),
    "fp8 float cache": (lambda a: {"kv_cache_dtype": "fp8"}, TypeError, "kv_cache"),
    "k_scale per head": (lambda a: {"kv_cache_dtype": "fp8", "kv_cache": a["kv_cache"].view(np.uint8)[..., :576],
                                    "k_scale": np.ones(2, np.float32)}, ValueError, "k_scale"),
    "out shape": (lambda a: {"out": np.zeros((2, 16, 576), np.float16)}, ValueError, "out"),
    "workspace too small": (lambda a: {"kv_split_size": 8, "workspace": np.zeros(64, np.uint8)}, ValueError,
                            "workspace must be a 1-D uint8 array of >= "),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_mla_decode_bad_input(backend, case):
    rng = np.random.default_rng(6)
    cache, table, _ = latent_pool(rng, [10, 20], 16, np.float16, "auto")
    a = dict(q=np.zeros((2, 16, 576), np.float16), kv_cache=cache, block_tables=table,
             seq_lens=np.array([10, 20], np.int32), scale=0.1)
    change, exc, match = BAD[case]
    a.update(change(a))
    a = {k: backend.asarray(v) if isinstance(v, np.ndarray) else v for k, v in a.items()}
    with pytest.raises(exc, match=match):
        cupaged.mla_decode(**a)


class UpProjection:
    """A fixed random up-projection latent [n, 576] -> (k [n, H, 192], v [n, H, 128]), standing in
    for the model's kv_b_proj: k = (kv_c W_k_nope, k_pe broadcast over heads), v = kv_c W_v."""

    def __init__(self, rng, heads, dtype, nope=128, rope=ROPE, vd=128):
        self.heads, self.nope, self.vd, self.dtype = heads, nope, vd, dtype
        self.w_k = (rng.standard_normal((RANK, heads * nope)) / np.sqrt(RANK)).astype(np.float32)
        self.w_v = (rng.standard_normal((RANK, heads * vd)) / np.sqrt(RANK)).astype(np.float32)

    def __call__(self, latent):
        xp = np if isinstance(latent, np.ndarray) else __import__("cupy")
        lat = latent.astype(xp.float32)
        n = lat.shape[0]
        k_nope = (lat[:, :RANK] @ xp.asarray(self.w_k)).reshape(n, self.heads, self.nope)
        k_pe = xp.broadcast_to(lat[:, None, RANK:], (n, self.heads, ROPE))
        k = xp.concatenate([k_nope, k_pe], axis=2).astype(self.dtype)
        v = (lat[:, :RANK] @ xp.asarray(self.w_v)).reshape(n, self.heads, self.vd).astype(self.dtype)
        return k, v


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("contexts, workspace_tokens", [
    ([30, 0, 17], 64),     # contexts shorter than the workspace: one chunk
    ([32, 32], 64),        # exactly the workspace
    ([200, 5, 131], 48),   # several times the workspace
    ([0, 0], 16),          # no cached context at all
    ([9, 4, 6], 2),        # fewer workspace rows than sequences with context (before: failed in the gather)
], ids=["shorter", "equal", "several", "none", "workspace<batch"])
def test_mla_chunked_prefill_matches_one_shot_attention(backend, kv_cache_dtype, contexts, workspace_tokens):
    rng = np.random.default_rng(sum(contexts) + workspace_tokens)
    heads, dtype, block_size = 4, np.float16, 16
    new_lens = [3, 6, 1][:len(contexts)]
    cache, table, scale = latent_pool(rng, contexts, block_size, dtype, kv_cache_dtype)
    up = UpProjection(rng, heads, dtype)
    cu_q = np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int32)
    q = (rng.standard_normal((cu_q[-1], heads, 192)) * 0.5).astype(dtype)
    new_latent = rng.standard_normal((cu_q[-1], RANK + ROPE)).astype(dtype)
    k_new, v_new = up(new_latent)
    out, lse = cupaged.mla_chunked_prefill(
        *(backend.asarray(a) for a in (q, k_new, v_new, cache, table, cu_q)), np.array(contexts, np.int32), up,
        workspace_tokens=workspace_tokens, kv_cache_dtype=kv_cache_dtype, k_scale=scale, return_lse=True)
    # one-shot reference: the whole context (dequantized, up-projected) followed by the new tokens
    ks, vs, cu_k = [], [], [0]
    for b, (ctx, n) in enumerate(zip(contexts, new_lens)):
        lat = reference.dense_kv(cache[:, :, None], cache[:, :, None], table[b], ctx, kv_cache_dtype=kv_cache_dtype,
                                 k_scale=scale, v_scale=scale)[0][:, 0].astype(dtype)
        k_ctx, v_ctx = up(lat)
        ks += [k_ctx, k_new[cu_q[b]:cu_q[b + 1]]]
        vs += [v_ctx, v_new[cu_q[b]:cu_q[b + 1]]]
        cu_k.append(cu_k[-1] + ctx + n)
    ref_out, ref_lse = reference.varlen_attention(q, np.concatenate(ks), np.concatenate(vs), cu_q,
                                                  np.array(cu_k, np.int32), causal=True)
    assert_close(backend.to_numpy(out), ref_out, dtype, "out")
    assert_close(backend.to_numpy(lse), ref_lse, "lse", "lse")


@pytest.mark.parametrize("contexts, workspace_tokens, allocations", [
    ([30, 0, 17], 64, 1),      # one chunk: the LSE pair; the new tokens' part lives in the dead latent rows
    ([200, 5, 131], 48, 2),    # eight chunks: + one part buffer, not one per chunk
    ([1500, 700], 1024, 3),    # split attention in two chunks: + one partials buffer for both
], ids=["one chunk", "several", "split chunks"])
def test_mla_chunked_prefill_allocates_per_call_not_per_chunk(backend, monkeypatch, contexts, workspace_tokens,
                                                              allocations):
    """With out= and workspace= given, the running state is merged in place into out and every
    scratch buffer serves all chunks (before: each chunk and the new tokens allocated an output and
    an LSE, and each merge another pair). Bit for bit the result of a call given neither."""
    import cupaged.attention
    import cupaged.mla

    rng = np.random.default_rng(11)
    cache, table, _ = latent_pool(rng, contexts, 16, np.float16, "auto")
    up = UpProjection(rng, 4, np.float16)
    cu_q = np.concatenate([[0], np.cumsum([3, 6, 1][:len(contexts)])]).astype(np.int32)
    q = (rng.standard_normal((cu_q[-1], 4, 192)) * 0.5).astype(np.float16)
    k_new, v_new = up(rng.standard_normal((cu_q[-1], RANK + ROPE)).astype(np.float16))
    args = [backend.asarray(a) for a in (q, k_new, v_new, cache, table, cu_q)]
    want, want_lse = cupaged.mla_chunked_prefill(*args, np.array(contexts), up, workspace_tokens=workspace_tokens,
                                                 return_lse=True)
    shapes = []
    for module in (cupaged.mla, cupaged.attention):
        monkeypatch.setattr(module, "empty", lambda xp, shape, dtype, real=module.empty: shapes.append(shape) or
                            real(xp, shape, dtype))
    out = backend.empty(want.shape, np.float16)
    got, lse = cupaged.mla_chunked_prefill(*args, np.array(contexts), up, out=out, return_lse=True,
                                           workspace=backend.empty((workspace_tokens, RANK + ROPE), np.float16))
    assert len(shapes) == allocations, shapes
    assert got is out
    assert np.array_equal(backend.to_numpy(got).view(np.uint16), backend.to_numpy(want).view(np.uint16))
    assert np.array_equal(backend.to_numpy(lse), backend.to_numpy(want_lse))


def test_mla_chunked_prefill_bad_input(backend):
    rng = np.random.default_rng(1)
    cache, table, _ = latent_pool(rng, [10, 20], 16, np.float16, "auto")
    a = [backend.asarray(x) for x in (np.zeros((2, 4, 192), np.float16), np.zeros((2, 4, 192), np.float16),
                                      np.zeros((2, 4, 128), np.float16), cache, table, np.array([0, 1, 2], np.int32))]
    with pytest.raises(ValueError, match="context_lens"):
        cupaged.mla_chunked_prefill(*a, np.array([10], np.int32), UpProjection(rng, 4, np.float16))
    with pytest.raises(ValueError, match="workspace_tokens"):
        cupaged.mla_chunked_prefill(*a, np.array([10, 20], np.int32), UpProjection(rng, 4, np.float16),
                                    workspace_tokens=0)


def test_mla_chunked_prefill_checks_scale_without_context(backend):
    rng = np.random.default_rng(2)
    cache, table, _ = latent_pool(rng, [0], 16, np.uint8, "fp8")
    a = [backend.asarray(x) for x in (np.zeros((1, 4, 192), np.float16), np.zeros((1, 4, 192), np.float16),
                                      np.zeros((1, 4, 128), np.float16), cache, table, np.array([0, 1], np.int32))]
    with pytest.raises(ValueError, match="k_scale"):
        cupaged.mla_chunked_prefill(*a, np.array([0], np.int32), UpProjection(rng, 4, np.float16),
                                    kv_cache_dtype="fp8", k_scale=-1.0)


def _prefill_args(backend, rng, contexts=(10, 20), heads=4):
    cache, table, _ = latent_pool(rng, list(contexts), 16, np.float16, "auto")
    n = len(contexts)
    cu_q = np.arange(n + 1, dtype=np.int32)
    arrays = [np.zeros((n, heads, 192), np.float16), np.zeros((n, heads, 192), np.float16),
              np.zeros((n, heads, 128), np.float16), cache, table, cu_q]
    return [backend.asarray(a) for a in arrays], np.array(contexts, np.int32)


def test_mla_chunked_prefill_checks_up_proj_heads(backend):
    """An up_proj returning 2 heads where k_new has 4 was silently taken as GQA."""
    rng = np.random.default_rng(7)
    args, contexts = _prefill_args(backend, rng)
    with pytest.raises(ValueError, match="up_proj's k must be \\[30, 4, 192\\]"):
        cupaged.mla_chunked_prefill(*args, contexts, UpProjection(rng, 2, np.float16))
    with pytest.raises(TypeError, match="up_proj"):
        cupaged.mla_chunked_prefill(*args, contexts, "not callable")


@pytest.mark.parametrize("change, exc, match", [
    (lambda a: {"out": np.zeros((2, 4, 192), np.float16)}, ValueError, "out"),
    (lambda a: {"scale": "x"}, TypeError, "scale"),
    (lambda a: {"return_lse": "yes"}, TypeError, "return_lse"),
    (lambda a: {"validate": "yes"}, TypeError, "validate"),
    (lambda a: {"kv_cache_dtype": "fp8"}, TypeError, "kv_cache"),
    (lambda a: {"workspace_tokens": 2.5}, TypeError, "workspace_tokens"),
], ids=["out shape", "scale", "return_lse", "validate", "fp8 float cache", "workspace_tokens float"])
def test_mla_chunked_prefill_checks_everything_before_the_first_launch(backend, change, exc, match):
    """Each bad argument is caught before the first gather writes the caller's workspace."""
    rng = np.random.default_rng(8)
    args, contexts = _prefill_args(backend, rng)
    workspace = backend.asarray(np.full((64, RANK + ROPE), 7, np.float16))
    kwargs = {k: backend.asarray(v) if isinstance(v, np.ndarray) else v for k, v in change(args).items()}
    with pytest.raises(exc, match=match):
        cupaged.mla_chunked_prefill(*args, contexts, UpProjection(rng, 4, np.float16), workspace=workspace, **kwargs)
    assert (backend.to_numpy(workspace) == 7).all(), "the workspace was written before the error"


def test_mla_chunked_prefill_validate(backend):
    rng = np.random.default_rng(9)
    args, contexts = _prefill_args(backend, rng)
    table = backend.to_numpy(args[4]).copy()
    table[1, 0] = 10**6
    args[4] = backend.asarray(table)
    with pytest.raises(ValueError, match="block_tables\\[1\\] holds block id 1000000"):
        cupaged.mla_chunked_prefill(*args, contexts, UpProjection(rng, 4, np.float16), validate=True)


def test_mla_decode_scale_is_required(backend):
    rng = np.random.default_rng(10)
    cache, table, _ = latent_pool(rng, [10], 16, np.float16, "auto")
    args = [backend.asarray(a) for a in (np.zeros((1, 16, 576), np.float16), cache, table, np.array([10], np.int32))]
    with pytest.raises(TypeError, match="mla_decode needs scale=.*qk_nope_head_dim"):
        cupaged.mla_decode(*args)


@pytest.mark.parametrize("kv_cache_dtype, split, heads, q_lens", [("auto", None, 16, [2, 1, 4, 6]),
                                                                  ("fp8", 64, 40, [3, 1, 20, 6])])
def test_mla_query_runs_through_run_attention(backend, kv_cache_dtype, split, heads, q_lens):
    """MTP / speculative decoding over the latent cache (run_attention with query_start_loc): every run takes
    mla_decode_kernel, a CTA one query of it at a time (16 heads: 128 threads; 40: 256, 32 heads a CTA), each query
    at its own causal position; a run of 20 is longer than the grid's 16 queries a sequence. Query i of a run of
    q_len sits at seq_len - q_len + i: the reference is a decode over that prefix."""
    rng = np.random.default_rng(6)
    seq_lens = np.array([300, 40, 129, 9], np.int32)
    cache, table, scale = latent_pool(rng, seq_lens.tolist(), 16, ml_dtypes.bfloat16, kv_cache_dtype)
    q = rng.standard_normal((sum(q_lens), heads, RANK + ROPE)).astype(ml_dtypes.bfloat16)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv = cupaged.KvView.mla(backend.asarray(cache), RANK, kv_cache_dtype)
    dev = [backend.asarray(x) for x in (q, table, seq_lens, qsl)]
    plan = cupaged.plan_attention(dev[0], kv, dev[1], dev[2], dev[3], kv_split_size=split)
    (launch,) = plan.launches  # no prefill kernel: MLA decode takes every query run
    assert "mla_decode_kernel" in launch.kernel and plan.decode_max_q == 2**31 - 1
    out = backend.asarray(np.full((len(q), heads, RANK), np.nan, ml_dtypes.bfloat16))
    cupaged.run_attention(plan, dev[0], kv, out, None, dev[1], dev[2], dev[3], scale=0.05, k_scale=scale,
                          v_scale=scale)  # the value is the latent row: one scale
    seq = np.repeat(np.arange(4), q_lens)
    prefix = np.concatenate([np.arange(n - ql + 1, n + 1) for n, ql in zip(seq_lens, q_lens)]).astype(np.int32)
    ref, _ = reference.mla_decode(q, cache, table[seq], prefix, scale=0.05, kv_cache_dtype=kv_cache_dtype,
                                  k_scale=scale)
    assert_close(backend.to_numpy(out), ref, tolerance(ml_dtypes.bfloat16, kv_cache_dtype))


def test_mla_decode_of_float32_q_is_not_implemented(backend):
    """float32 q over a latent cache: a NotImplementedError naming q's dtype before any launch (mla_decode_kernel
    runs on tensor cores, as FlashMLA's and FlashInfer's MLA kernels do), out untouched."""
    rng = np.random.default_rng(9)
    cache, table, _ = latent_pool(rng, [40], 16, np.float32, "auto")
    out = backend.asarray(np.full((1, 16, RANK), 7.0, np.float32))
    args = [backend.asarray(a) for a in (np.zeros((1, 16, 576), np.float32), cache, table, np.array([40], np.int32))]
    with pytest.raises(NotImplementedError, match="float32"):
        cupaged.mla_decode(*args, scale=0.05, out=out)
    assert (backend.to_numpy(out) == 7.0).all()
