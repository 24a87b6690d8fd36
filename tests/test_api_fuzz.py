"""API fuzz test over every public op (hypothesis, derandomized): random shapes, dtypes, layouts and
options, and in most examples one argument swapped for a bad value (a wrong type, dtype, rank or
value, or -- with validate=True -- a bad index inside an array). Every call either raises a
TypeError / ValueError / NotImplementedError whose message names the swapped argument, before
anything is written, or returns what cupaged.reference computes. `-m slow` runs twelve times more.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupaged
from cupaged import reference, sim
from cupaged.testing import TOLERANCES, assert_close, tolerance
from tests.test_mla import UpProjection, latent_pool
from tests.test_paged_attention import Case, build
from tests.test_paged_attention_vllm import to_vllm

DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16)
KV = ("auto", "fp8", "fp8_e5m2")
BAD_VALUES = {  # kind -> bad values (the catalogue the fuzzer draws from)
    "array": (lambda a: list(np.asarray(a).tolist()), lambda a: np.asarray(a).astype(np.float64),
              lambda a: np.asarray(a)[None]),
    "index": (lambda a: a.tolist(), lambda a: a.astype(np.float32), lambda a: a[None]),
    "int": (lambda v: "3", lambda v: 2.5, lambda v: -5),
    "float": (lambda v: "x", lambda v: [0.1], lambda v: float("nan")),
    "bool": (lambda v: "no", lambda v: 0.5),
    "choice": (lambda v: "bogus", lambda v: 3),
    "caches": (lambda v: v[0], lambda v: [np.zeros(3, np.float32)]),  # a list of per-layer caches
}


class Call:
    """One op call: keyword arguments, the arrays it writes, the kind of each fuzzable argument and
    the entries of index arrays that must be read (set to a huge value, validate=True must catch them)."""

    def __init__(self, fn, kwargs, written, kinds, check, contents=()):
        self.fn, self.kwargs, self.written, self.kinds, self.check = fn, kwargs, written, kinds, check
        self.contents = contents  # (argument, index) pairs


def _rng(data):
    return np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))


def paged_call(data):
    kv = data.draw(st.sampled_from(KV), label="kv_cache_dtype")
    decode = data.draw(st.booleans(), label="decode")
    lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3), label="seq_lens")
    seqs = tuple((1 if decode else data.draw(st.integers(0, min(s, 20))), s) for s in lens)
    causal = decode or data.draw(st.booleans(), label="causal")
    case = Case(heads=data.draw(st.sampled_from([(4, 4), (4, 2), (3, 1), (16, 2)])),
                head_size=data.draw(st.sampled_from([32, 40, 64, 128])),
                block_size=data.draw(st.sampled_from([1, 5, 16])),
                seqs=seqs, dtype=data.draw(st.sampled_from(DTYPES)), layout=data.draw(st.sampled_from(["NHD", "HND"])),
                kv_cache_dtype=kv, causal=causal, window=data.draw(st.sampled_from([None, 7])) if causal else None,
                softcap=data.draw(st.sampled_from([None, 0.0, 20.0])), sinks=data.draw(st.booleans()),
                alibi=data.draw(st.booleans()), decode=decode)
    inputs, options, (ref_out, ref_lse) = build(case, seed=data.draw(st.integers(0, 99)))
    split = data.draw(st.sampled_from([None, 1, 16]), label="kv_split_size")
    kwargs = {**{k: sim.asarray(v) if isinstance(v, np.ndarray) else v for k, v in {**inputs, **options}.items()},
              "kv_split_size": split, "out": sim.zeros(ref_out.shape, case.dtype), "return_lse": True, "validate": True}

    def check(result):
        assert_close(result[0], ref_out, tolerance(case.dtype, kv), "out")
        assert_close(result[1], ref_lse, "lse", "lse")
    kinds = dict(q="array", key_cache="array", value_cache="array", block_tables="index", seq_lens="index",
                 out="array", causal="bool", scale="float", kv_split_size="int", layout="choice",
                 kv_cache_dtype="choice", sliding_window="int", max_seq_len="int", return_lse="bool", validate="bool")
    if not decode:
        kinds["query_start_loc"], kinds["max_query_len"] = "index", "int"
    if kv != "auto":
        kinds["k_scale"] = kinds["v_scale"] = "float"
    return Call(cupaged.paged_attention, kwargs, ["out"], kinds, check,
                [("block_tables", (0, 0)), ("seq_lens", (0,))] + ([] if decode else [("query_start_loc", (1,))]))


def vllm_call(data, version):
    dtype = data.draw(st.sampled_from(DTYPES))
    heads = data.draw(st.sampled_from([(4, 4), (4, 2), (6, 1)]))
    lens = data.draw(st.lists(st.integers(1, 600), min_size=1, max_size=3), label="seq_lens")
    case = Case(heads=heads, head_size=data.draw(st.sampled_from([64, 128])),
                block_size=data.draw(st.sampled_from([8, 16])), seqs=tuple((1, s) for s in lens), dtype=dtype)
    inputs, _, _ = build(case, seed=data.draw(st.integers(0, 99)))
    kc, vc = to_vllm(inputs["key_cache"], "k"), to_vllm(inputs["value_cache"], "v")
    q, tables, seq_lens = inputs["q"], inputs["block_tables"], inputs["seq_lens"]
    scale, max_seq_len = 1 / math.sqrt(case.head_size), int(seq_lens.max())
    ref = reference.paged_attention_v1(q, kc, vc, heads[1], scale, tables, seq_lens)
    kwargs = dict(out=sim.zeros(q.shape, dtype), query=sim.asarray(q), key_cache=sim.asarray(kc),
                  value_cache=sim.asarray(vc), num_kv_heads=heads[1], scale=scale, block_tables=sim.asarray(tables),
                  seq_lens=sim.asarray(seq_lens), block_size=case.block_size, max_seq_len=max_seq_len,
                  alibi_slopes=None, validate=True)
    kinds = dict(out="array", query="array", key_cache="array", num_kv_heads="int", scale="float",
                 block_tables="index", seq_lens="index", block_size="int", max_seq_len="int", tp_rank="int")
    fn = cupaged.paged_attention_v1
    if version == 2:
        fn, parts = cupaged.paged_attention_v2, -(-max_seq_len // 512)
        kwargs.update(exp_sums=sim.zeros((len(lens), heads[0], parts), np.float32),
                      max_logits=sim.zeros((len(lens), heads[0], parts), np.float32),
                      tmp_output=sim.zeros((len(lens), heads[0], parts, case.head_size), dtype))
        kinds.update(exp_sums="array", max_logits="array", tmp_output="array")
    # v2 rounds its partials to the query's dtype, as vLLM does: up to twice the rounding of v1
    tol = tuple((1 if version == 1 else 2) * t for t in TOLERANCES[np.dtype(dtype)])

    def check(_):
        assert_close(kwargs["out"], ref, tol, "out")
    return Call(fn, kwargs, ["out"] + (["exp_sums", "max_logits", "tmp_output"] if version == 2 else []), kinds, check,
                [("block_tables", (0, 0)), ("seq_lens", (0,))])


def varlen_call(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    lens_q = data.draw(st.lists(st.integers(0, 20), min_size=1, max_size=3))
    lens_k = [data.draw(st.integers(1, 30)) for _ in lens_q]
    heads = data.draw(st.sampled_from([(4, 4), (4, 2), (2, 1)]))
    qk, vd = data.draw(st.sampled_from([(64, 64), (192, 128), (40, 40)]))
    rng = _rng(data)
    cq, ck = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    q = (rng.standard_normal((cq[-1], heads[0], qk)) * 0.5).astype(dtype)
    k = rng.standard_normal((ck[-1], heads[1], qk)).astype(dtype)
    v = rng.standard_normal((ck[-1], heads[1], vd)).astype(dtype)
    causal = data.draw(st.booleans())
    ref_out, ref_lse = reference.varlen_attention(q, k, v, cq, ck, causal=causal)
    kwargs = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=causal, return_lse=True, validate=True,
                  out=sim.zeros(ref_out.shape, dtype))

    def check(result):
        assert_close(result[0], ref_out, dtype, "out")
        assert_close(result[1], ref_lse, "lse", "lse")
    kinds = dict(q="array", k="array", v="array", cu_seqlens_q="index", cu_seqlens_k="index", causal="bool",
                 scale="float", max_seqlen_q="int", max_seqlen_k="int", out="array")
    return Call(cupaged.varlen_attention, kwargs, ["out"], kinds, check, [("cu_seqlens_k", (1,))])


def mla_call(data):
    dtype = data.draw(st.sampled_from(DTYPES[1:]))
    kv = data.draw(st.sampled_from(KV))
    lens = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=3))
    rng = _rng(data)
    cache, table, k_scale = latent_pool(rng, lens, data.draw(st.sampled_from([16, 64])), dtype, kv)
    q = (rng.standard_normal((len(lens), data.draw(st.sampled_from([16, 20])), 576)) * 0.5).astype(dtype)
    seq_lens = np.array(lens, np.int32)
    ref_out, ref_lse = reference.mla_decode(q, cache, table, seq_lens, scale=0.05, kv_cache_dtype=kv, k_scale=k_scale)
    split = data.draw(st.sampled_from([None, 64]))
    kwargs = dict(q=q, kv_cache=sim.asarray(cache), block_tables=table, seq_lens=seq_lens, kv_lora_rank=512,
                  scale=0.05, kv_cache_dtype=kv, k_scale=k_scale, kv_split_size=split, return_lse=True,
                  validate=True, out=sim.zeros(ref_out.shape, dtype))

    def check(result):
        assert_close(result[0], ref_out, tolerance(dtype, kv), "out")
        assert_close(result[1], ref_lse, "lse", "lse")
    kinds = dict(q="array", kv_cache="array", block_tables="index", seq_lens="index", kv_lora_rank="int",
                 scale="float", kv_split_size="int", max_seq_len="int", kv_cache_dtype="choice", out="array")
    if kv != "auto":
        kinds["k_scale"] = "float"
    return Call(cupaged.mla_decode, kwargs, ["out"], kinds, check, [("block_tables", (0, 0)), ("seq_lens", (0,))])


def merge_call(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    tokens, heads = data.draw(st.integers(0, 20)), data.draw(st.integers(1, 4))
    size = data.draw(st.sampled_from([8, 64]))
    rng = _rng(data)
    po, so = (rng.standard_normal((tokens, heads, size)).astype(dtype) for _ in range(2))
    pl, sl = (rng.uniform(-3, 3, (heads, tokens)).astype(np.float32) for _ in range(2))
    n = data.draw(st.integers(0, tokens))
    ref, ref_lse = reference.merge_attn_states(po, pl, so, sl, n)
    kwargs = dict(output=sim.zeros(po.shape, dtype), prefix_output=po, prefix_lse=pl, suffix_output=so,
                  suffix_lse=sl, output_lse=sim.zeros((heads, tokens), np.float32), prefill_tokens_with_context=n)

    def check(_):
        assert_close(kwargs["output"], ref, dtype, "output")
        assert_close(kwargs["output_lse"], ref_lse, "lse", "output_lse")
    kinds = dict(output="array", prefix_output="array", prefix_lse="array", suffix_output="array",
                 suffix_lse="array", output_lse="array", prefill_tokens_with_context="int")
    return Call(cupaged.merge_attn_states, kwargs, ["output", "output_lse"], kinds, check)


def cache_write_call(data):
    op = data.draw(st.sampled_from(["flash", "vllm", "mla"]))
    dtype, kv = data.draw(st.sampled_from(DTYPES)), data.draw(st.sampled_from(KV))
    rng = _rng(data)
    block_size, num_blocks = data.draw(st.sampled_from([1, 5, 16])), 6
    tokens = data.draw(st.integers(0, num_blocks * block_size))
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(data.draw(st.sampled_from([np.int64, np.int32])))
    slots[::4] = -1
    cache_dt = dtype if kv == "auto" else np.uint8
    if op == "mla":
        kv_c, k_pe = rng.standard_normal((tokens, 64)).astype(dtype), rng.standard_normal((tokens, 16)).astype(dtype)
        cache = np.zeros((num_blocks, block_size, 80), cache_dt)
        ref = reference.concat_and_cache_mla(kv_c, k_pe, cache, slots, kv, 0.05)
        kwargs = dict(kv_c=kv_c, k_pe=k_pe, kv_cache=sim.asarray(cache), slot_mapping=slots, kv_cache_dtype=kv,
                      scale=0.05, validate=True)
        kinds = dict(kv_c="array", k_pe="array", kv_cache="array", slot_mapping="index", kv_cache_dtype="choice")

        def check(_):
            assert np.array_equal(kwargs["kv_cache"].view(np.uint8), ref.view(np.uint8))
        return Call(cupaged.concat_and_cache_mla, kwargs, ["kv_cache"], kinds, check,
                    [("slot_mapping", (1,))] if tokens > 1 else ())
    heads, size = data.draw(st.sampled_from([1, 3])), 32
    key, value = (rng.standard_normal((tokens, heads, size)).astype(dtype) for _ in range(2))
    if op == "flash":
        layout = data.draw(st.sampled_from(["NHD", "HND"]))
        shape = (num_blocks, block_size, heads, size) if layout == "NHD" else (num_blocks, heads, block_size, size)
        kc, vc = np.zeros(shape, cache_dt), np.zeros(shape, cache_dt)
        ref = reference.reshape_and_cache_flash(key, value, kc, vc, slots, kv, 0.05, 0.07, layout=layout)
        fn, extra = cupaged.reshape_and_cache_flash, dict(layout=layout)
    else:
        x = 16 // np.dtype(cache_dt).itemsize
        kc = np.zeros((num_blocks, heads, size // x, block_size, x), cache_dt)
        vc = np.zeros((num_blocks, heads, size, block_size), cache_dt)
        ref = reference.reshape_and_cache(key, value, kc, vc, slots, kv, 0.05, 0.07)
        fn, extra = cupaged.reshape_and_cache, {}
    kwargs = dict(key=key, value=value, key_cache=sim.asarray(kc), value_cache=sim.asarray(vc), slot_mapping=slots,
                  kv_cache_dtype=kv, k_scale=0.05, v_scale=0.07, validate=True, **extra)

    def check(_):
        for name, want in zip(("key_cache", "value_cache"), ref):
            assert np.array_equal(kwargs[name].view(np.uint8), want.view(np.uint8)), name
    kinds = dict(key="array", value="array", key_cache="array", value_cache="array", slot_mapping="index",
                 kv_cache_dtype="choice", **({"layout": "choice"} if extra else {}))
    if kv != "auto":
        kinds["k_scale"] = kinds["v_scale"] = "float"
    return Call(fn, kwargs, ["key_cache", "value_cache"], kinds, check, [("slot_mapping", (1,))] if tokens > 1 else ())


def gather_call(data):
    rng = _rng(data)
    dtype, kv = data.draw(st.sampled_from(DTYPES)), data.draw(st.sampled_from(KV))
    lens = data.draw(st.lists(st.integers(1, 30), min_size=1, max_size=3))
    block_size = data.draw(st.sampled_from([4, 16]))
    cache, table, scale = latent_pool(rng, lens, block_size, dtype, kv)
    cache = np.ascontiguousarray(cache[..., :48])
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    if data.draw(st.booleans(), label="cp_gather"):  # a raw copy: dst has the cache's dtype
        dst0 = np.zeros((int(cu[-1]), 48), cache.dtype)
        ref = reference.cp_gather_cache(cache, dst0, table, cu, len(lens))
        kwargs = dict(src_cache=sim.asarray(cache), dst=sim.asarray(dst0), block_table=table, cu_seq_lens=cu,
                      batch_size=len(lens), validate=True)
        kinds = dict(src_cache="array", dst="array", block_table="index", cu_seq_lens="index", batch_size="int")
        fn = cupaged.cp_gather_cache
    else:
        dst0 = np.zeros((int(cu[-1]), 48), dtype)
        t2s = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
        ref = reference.gather_and_maybe_dequant_cache(cache, dst0, table, cu, t2s, int(cu[-1]), kv, scale)
        kwargs = dict(src_cache=sim.asarray(cache), dst=sim.asarray(dst0), block_table=table, cu_seq_lens=cu,
                      token_to_seq=t2s, num_tokens=int(cu[-1]), kv_cache_dtype=kv, scale=scale, validate=True)
        kinds = dict(src_cache="array", dst="array", block_table="index", cu_seq_lens="index", token_to_seq="index",
                     num_tokens="int", kv_cache_dtype="choice", **({"scale": "float"} if kv != "auto" else {}))
        fn = cupaged.gather_and_maybe_dequant_cache

    def check(_):
        assert np.array_equal(kwargs["dst"].view(np.uint8), ref.view(np.uint8))
    return Call(fn, kwargs, ["dst"], kinds, check, [("block_table", (0, 0))])


def copy_call(data):
    rng = _rng(data)
    caches = [rng.standard_normal((6, 4, 2, 8)).astype(data.draw(st.sampled_from(DTYPES))) for _ in range(2)]
    src, dst = rng.permutation(3), 3 + rng.permutation(3)  # no block both read and written
    pairs = np.stack([src, dst] if data.draw(st.booleans()) else [dst, src], axis=1).astype(np.int64)
    ref_k, ref_v = reference.copy_blocks(caches[:1], caches[1:], pairs)
    kwargs = dict(key_caches=[sim.asarray(caches[0])], value_caches=[sim.asarray(caches[1])], block_mapping=pairs,
                  validate=True)

    def check(_):
        assert np.array_equal(kwargs["key_caches"][0], ref_k[0]) and np.array_equal(kwargs["value_caches"][0], ref_v[0])
    return Call(cupaged.copy_blocks, kwargs, ["key_caches", "value_caches"],
                dict(block_mapping="index", key_caches="caches", value_caches="caches"), check,
                [("block_mapping", (0, 0))])


def swap_call(data):
    rng = _rng(data)
    src = rng.standard_normal((5, 4, 8)).astype(data.draw(st.sampled_from(DTYPES)))
    dst = np.zeros((7, 4, 8), src.dtype)
    pairs = np.stack([rng.permutation(5)[:3], rng.permutation(7)[:3]], axis=1).astype(np.int64)
    ref = reference.swap_blocks(src, dst, pairs)
    kwargs = dict(src=src, dst=dst, block_mapping=pairs)

    def check(_):
        assert np.array_equal(kwargs["dst"], ref)
    return Call(cupaged.swap_blocks, kwargs, ["dst"], dict(src="array", dst="array", block_mapping="index"), check,
                [("block_mapping", (0, 1))])


def prefill_call(data):
    """mla_chunked_prefill against one-shot attention over the up-projected context and the new tokens."""
    rng = _rng(data)
    contexts = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))
    new = [data.draw(st.integers(1, 4)) for _ in contexts]
    cache, table, _ = latent_pool(rng, contexts, 16, np.float16, "auto")
    up = UpProjection(rng, 2, np.float16)
    cu_q = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = (rng.standard_normal((cu_q[-1], 2, 192)) * 0.5).astype(np.float16)
    k_new, v_new = up(rng.standard_normal((cu_q[-1], 576)).astype(np.float16))
    ks, vs, cu_k = [], [], [0]
    for b, ctx in enumerate(contexts):
        lat = reference.dense_kv(cache[:, :, None], cache[:, :, None], table[b], ctx)[0][:, 0].astype(np.float16)
        k_ctx, v_ctx = up(lat)
        ks += [k_ctx, k_new[cu_q[b]:cu_q[b + 1]]]
        vs += [v_ctx, v_new[cu_q[b]:cu_q[b + 1]]]
        cu_k.append(cu_k[-1] + ctx + new[b])
    ref, _ = reference.varlen_attention(q, np.concatenate(ks), np.concatenate(vs), cu_q, np.array(cu_k, np.int32))
    kwargs = dict(q=q, k_new=k_new, v_new=v_new, kv_cache=sim.asarray(cache), block_tables=table, cu_seqlens_q=cu_q,
                  context_lens=np.array(contexts, np.int32), up_proj=up, validate=True,
                  workspace_tokens=data.draw(st.sampled_from([1, 7, 64])), out=sim.zeros(ref.shape, np.float16))

    # every merge rounds the running output to q's dtype (as vLLM's chunked-context path does)
    merges = -(-sum(contexts) // kwargs["workspace_tokens"]) + 1
    tol = tuple(t * math.sqrt(merges) for t in TOLERANCES[np.dtype(np.float16)])

    def check(result):
        assert_close(result, ref, tol, "out")
    kinds = dict(q="array", k_new="array", v_new="array", kv_cache="array", block_tables="index",
                 cu_seqlens_q="index", workspace_tokens="int", scale="float", return_lse="bool", out="array")
    return Call(cupaged.mla_chunked_prefill, kwargs, ["out"], kinds, check,
                [("block_tables", (int(np.argmax(contexts)), 0))] if max(contexts) else ())


def host_objects_call(data):
    """KVCache and BlockPool: shapes and sizes from their arguments."""
    if data.draw(st.booleans(), label="KVCache"):
        layout = data.draw(st.sampled_from(["NHD", "HND", "vllm", "mla"]))
        heads = 1 if layout == "mla" else data.draw(st.integers(1, 3))
        kwargs = dict(num_layers=data.draw(st.integers(1, 3)), num_blocks=data.draw(st.integers(1, 5)),
                      block_size=data.draw(st.integers(1, 16)), num_kv_heads=heads, head_size=64,
                      dtype=data.draw(st.sampled_from(DTYPES)), layout=layout,
                      kv_cache_dtype=data.draw(st.sampled_from(KV)))

        def check(kv):
            assert kv.key(kwargs["num_layers"] - 1).size == kwargs["num_blocks"] * kwargs["block_size"] * heads * 64
        kinds = dict(num_layers="int", num_blocks="int", block_size="int", num_kv_heads="int", head_size="int",
                     layout="choice", kv_cache_dtype="choice")
        return Call(cupaged.KVCache, kwargs, [], kinds, check)
    kwargs = dict(num_blocks=data.draw(st.integers(1, 50)), block_size=data.draw(st.integers(1, 16)),
                  enable_prefix_caching=data.draw(st.booleans()),
                  max_blocks_per_seq=data.draw(st.sampled_from([None, 4])))

    def check(pool):
        assert pool.num_free_blocks == kwargs["num_blocks"] and pool.block_size == kwargs["block_size"]
    kinds = dict(num_blocks="int", block_size="int", enable_prefix_caching="bool", max_blocks_per_seq="int")
    return Call(cupaged.BlockPool, kwargs, [], kinds, check)


OPS = {"paged_attention": paged_call, "paged_attention_v1": lambda d: vllm_call(d, 1),
       "paged_attention_v2": lambda d: vllm_call(d, 2), "varlen_attention": varlen_call, "mla_decode": mla_call,
       "merge_attn_states": merge_call, "cache writes": cache_write_call, "gathers": gather_call,
       "copy_blocks": copy_call, "swap_blocks": swap_call, "mla_chunked_prefill": prefill_call,
       "KVCache and BlockPool": host_objects_call}


def _snapshot(call):
    return {n: np.array(call.kwargs[n], copy=True) for n in call.written}


def run_example(data, make):
    call = make(data)
    mutate = data.draw(st.sampled_from(["none", "value", "contents"] if call.contents else ["none", "value"]))
    if mutate == "none":
        call.check(call.fn(**call.kwargs))
        return
    if mutate == "value":
        name = data.draw(st.sampled_from(sorted(call.kinds)), label="argument")
        bad = data.draw(st.sampled_from(BAD_VALUES[call.kinds[name]]), label="bad value")(call.kwargs.get(name))
    else:
        name, index = data.draw(st.sampled_from(call.contents), label="content")
        bad = np.array(call.kwargs[name], copy=True)
        bad[index] = 10**6
    before = _snapshot(call)
    with pytest.raises((TypeError, ValueError, NotImplementedError)) as raised:
        call.fn(**{**call.kwargs, name: bad})
    assert name in str(raised.value), f"{name}={bad!r}: the message does not name it: {raised.value}"
    for n, a in before.items():
        assert np.array_equal(np.asarray(call.kwargs[n]).view(np.uint8), a.view(np.uint8)), f"{n} was written"


def _fuzz(op, examples):
    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        run_example(data, OPS[op])
    fuzz()


@pytest.mark.parametrize("op", OPS)
def test_api_fuzz(op):
    _fuzz(op, 50)


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
def test_api_fuzz_long(op):
    _fuzz(op, 600)
