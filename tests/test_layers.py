"""Attention (cupaged/layers.py) against cupaged.reference.layers.attention, on the sim (and cuda with a GPU).

The oracle is the float64 transcription of the attention module the layer follows (cupaged/reference/layers.py), run per sequence over the sequence's whole token
history with its own DenseCache: causal attention over the history at once equals the step-by-step run in exact
arithmetic, so every step's rows of the layer's output must match the reference's rows at the same positions.
The layer instead runs steps of a BlockPool's plans (prefill chunks of awkward lengths, decode tokens, sequences
arriving late, one freed so its blocks come back shuffled) over a shared paged KVCache that starts poisoned.
Weights are standard normal / sqrt(fan_in), so every activation is O(1). The default run is a covering set; `-m
slow` runs the product of head counts, RoPE styles, QKV and QK-norm options and dtypes. The last section runs the
model families' options (cupaged/_layer_options.py) and every RoPE scaling the same way, a Gemma-2-like alternating
stack and a gpt-oss-like layer (sinks + window + biases + YaRN) among them.
"""

from __future__ import annotations

import dataclasses
import itertools

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import KVCache
from cupaged.layers import Attention, ContextCache
from cupaged.reference import dequantize_fp8, quantize_fp8
from cupaged.reference import layers as ref
from cupaged.testing import TOLERANCES, assert_close, compare, tolerance
from tests.conftest import Backend

F16, BF16, F32 = np.float16, ml_dtypes.bfloat16, np.float32
DIM, HEAD_DIM = 64, 64
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # a short original context, so the scaling shows at ~100 tokens
ROPES = {  # RotaryEmbedding's arguments after head_dim
    None: None,
    "neox": {},
    "gptj": {"is_neox_style": False},
    "partial-neox": {"rotary_dim": 32, "rope_theta": 1e6},
    "partial-gptj": {"rotary_dim": 16, "is_neox_style": False},
    "llama3": {"rope_theta": 500000.0, "scaling": LLAMA3},
}
# A 16-bit layer rounds four tensors on the way to its output (the q / k / v projections, QK-norm and RoPE, the
# attention output, the output projection), each to within about one ulp of the exact value of its own rounded
# inputs, and the weights keep each error O(1 ulp) on the way out; so its output is held to four times the
# table's 16-bit tolerance, which the table sets for a single rounding. float32 keeps the table's tolerance.
ROUNDINGS = 4
_SIM = Backend("sim")  # for the tests of argument checks: no scheduling order matters there


@dataclasses.dataclass
class Case:
    heads: tuple = (8, 2)  # (n_heads, n_kv_heads): GQA 1, 4 or 8 below
    fuse_qkv: bool = False
    qk_norm: bool = False
    rope: str | None = "neox"
    dtype: type = F32
    block_size: int = 16
    layout: str = "NHD"
    kv_cache_dtype: str = "auto"
    context_dim: int | None = None  # cross attention's context width (None: DIM)

    def id(self):
        fields = [f"h{self.heads[0]}-{self.heads[1]}", "fused" if self.fuse_qkv else "split",
                  "qknorm" if self.qk_norm else "noqknorm", f"rope-{self.rope}", np.dtype(self.dtype).name,
                  f"bs{self.block_size}", self.layout]
        if self.kv_cache_dtype != "auto":
            fields.append(self.kv_cache_dtype)
        if self.context_dim:
            fields.append(f"ctx{self.context_dim}")
        return "-".join(fields)

    def tolerance(self):
        if self.kv_cache_dtype != "auto":  # against the reference whose cache holds the same fp8 values
            return tolerance(self.dtype, self.kv_cache_dtype)
        atol, rtol = TOLERANCES[np.dtype(self.dtype)]
        return (atol, rtol) if np.dtype(self.dtype) == F32 else (ROUNDINGS * atol, ROUNDINGS * rtol)


def rotary(case: Case):
    kwargs = ROPES[case.rope]
    return None if kwargs is None else cupaged.RotaryEmbedding(HEAD_DIM, **kwargs)


def weights(rng, case: Case, fused=None):
    """The layer's weights in its dtype (the reference reads the same rounded values), ``wqkv`` when ``fused``
    (default: the case's), else wq / wk / wv."""
    (n_heads, n_kv_heads), ctx = case.heads, case.context_dim or DIM

    def linear(out_features, in_features):
        return rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)

    w = {"wq": linear(n_heads * HEAD_DIM, DIM), "wk": linear(n_kv_heads * HEAD_DIM, ctx),
         "wv": linear(n_kv_heads * HEAD_DIM, ctx), "wo": linear(DIM, n_heads * HEAD_DIM)}
    if case.qk_norm:
        w["q_norm"], w["k_norm"] = 1 + 0.2 * rng.standard_normal((2, HEAD_DIM))
    if case.fuse_qkv if fused is None else fused:
        w["wqkv"] = np.concatenate([w.pop("wq"), w.pop("wk"), w.pop("wv")])
    return {k: v.astype(case.dtype) for k, v in w.items()}


def layer(backend, case: Case, w, attn_type="self", **kwargs):
    n_heads, n_kv_heads = case.heads
    attn = Attention(n_heads, n_kv_heads, DIM, head_dim=HEAD_DIM, context_dim=case.context_dim,
                     fuse_qkv=case.fuse_qkv, use_qk_normalization=case.qk_norm, attn_type=attn_type,
                     rope=rotary(case), dtype=case.dtype, **kwargs)
    attn.load_state_dict({k: backend.asarray(v) for k, v in w.items()})
    return attn


class _Fp8Rounded(np.ndarray):
    """A DenseCache array that keeps what an fp8 cache (scale 1) keeps of each value written into it, so the
    reference reads the keys and values the layer reads (testing.TOLERANCES: fp8 compares against the
    dequantized reference)."""

    def __setitem__(self, index, value):
        super().__setitem__(index, dequantize_fp8(quantize_fp8(value, 1.0, "fp8"), 1.0, "fp8"))


def reference(case: Case, w, x, attn_type="self", context=None):
    """The float64 reference of one sequence over ``x`` ``[seq_len, DIM]``, its whole history."""
    n_heads, n_kv_heads = case.heads
    cache = None
    if attn_type == "self":
        cache = ref.DenseCache(n_kv_heads, x.shape[0], HEAD_DIM)
        if case.kv_cache_dtype != "auto":
            cache.k, cache.v = cache.k.view(_Fp8Rounded), cache.v.view(_Fp8Rounded)
    return ref.attention(w, x, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=HEAD_DIM, attn_type=attn_type,
                         rope=rotary(case), cache=cache, context=context)


def kv_cache(backend, case: Case, num_blocks, num_layers=2):
    return KVCache(num_layers, num_blocks, case.block_size, case.heads[1], HEAD_DIM, case.dtype,
                   layout=case.layout, kv_cache_dtype=case.kv_cache_dtype, xp=backend.xp)


def cache_bytes(kv: KVCache, backend):
    return [backend.to_numpy(c).view(np.uint8).copy() for c in kv.key_caches + kv.value_caches]


# -- self attention over a paged cache: mixed steps ----------------------------------------------------------

# Each step: (seq_id, new tokens) in batch order; "x" is freed after the first step, so "a"'s next chunk and "c"
# take its blocks back out of order. The last step is a decode step (plan_decode).
SELF_STEPS = (
    (("a", 37), ("b", 21), ("x", 11)),   # prefill chunks
    (("a", 37), ("b", 1), ("c", 19)),    # a's next chunk, a decode token, a new sequence
    ("a", "b", "c"),                     # plan_decode
)


def run_self_steps(backend, case: Case, seed=0, layer_index=1):
    """Run SELF_STEPS through one layer, pool and KVCache (layer ``layer_index`` of 2) and check every step's
    output against the reference over each sequence's history; returns the cache."""
    rng = np.random.default_rng(seed)
    w = weights(rng, case)
    attn = layer(backend, case, w)
    history = {s: rng.standard_normal((80, DIM)).astype(case.dtype) for s in "abcx"}
    num_blocks = 2 * 80 // case.block_size + 8
    pool, kv = cupaged.BlockPool(num_blocks, case.block_size), kv_cache(backend, case, num_blocks)
    lens = dict.fromkeys("abcx", 0)
    for step in SELF_STEPS:
        if isinstance(step[0], str):
            plan, new = pool.plan_decode(list(step)), [(s, 1) for s in step]
        else:
            plan, new = pool.plan(step), step
        x = np.concatenate([history[s][lens[s]:lens[s] + n] for s, n in new])
        out = backend.to_numpy(attn.forward(backend.asarray(x), plan, kv, layer_index))
        assert out.shape == (x.shape[0], DIM) and out.dtype == case.dtype
        start = 0
        for s, n in new:
            want = reference(case, w, history[s][:lens[s] + n])[lens[s]:]
            assert_close(out[start:start + n], want, case.tolerance(), f"step {SELF_STEPS.index(step)} {s}")
            start, lens[s] = start + n, lens[s] + n
        if "x" in pool:
            pool.free("x")
    return kv


C = Case
SELF_CASES = [
    C(heads=(8, 8), fuse_qkv=True, qk_norm=True, rope="neox"),
    C(heads=(8, 2), rope="gptj", block_size=5),
    C(heads=(8, 1), fuse_qkv=True, rope="partial-neox", block_size=32, layout="HND"),
    C(heads=(8, 2), qk_norm=True, rope="llama3", block_size=5, layout="HND"),
    C(heads=(8, 1), rope=None),
    C(heads=(8, 8), fuse_qkv=True, rope="partial-gptj", block_size=32),
    C(heads=(8, 2), fuse_qkv=True, qk_norm=True, rope="neox", dtype=F16),
    C(heads=(8, 1), rope="gptj", dtype=BF16, block_size=5, layout="HND"),
    C(heads=(8, 8), qk_norm=True, rope="llama3", dtype=BF16, block_size=32),
    C(heads=(8, 2), qk_norm=True, rope="neox", kv_cache_dtype="fp8"),
    C(heads=(8, 1), fuse_qkv=True, rope=None, kv_cache_dtype="fp8", block_size=5, layout="HND"),
]


@pytest.mark.parametrize("case", SELF_CASES, ids=[c.id() for c in SELF_CASES])
def test_self_attention_over_mixed_steps(backend, case):
    kv = run_self_steps(backend, case)
    # layer 1 was written; layer 0 is as a new cache starts (0xFF bytes; the poison byte on the sim)
    start = cache_bytes(kv_cache(backend, case, 1), backend)[0].reshape(-1)[0]
    assert all((b == start).all() for b in cache_bytes(kv, backend)[0::2])


SLOW_SELF = [C(heads=h, fuse_qkv=f, qk_norm=n, rope=r, dtype=d, block_size=bs)
             for h, f, n, r, d, bs in itertools.product(((8, 8), (8, 2), (8, 1)), (False, True), (False, True),
                                                        ROPES, (F32, F16, BF16), (5, 16))]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_SELF, ids=[c.id() for c in SLOW_SELF])
def test_self_attention_full_grid(backend, case):
    run_self_steps(backend, case)


def test_prefix_cache_hits_are_attended_through_the_shared_blocks(backend):
    """A sequence whose first two blocks the prefix cache holds: those tokens stay in the batch with slot -1, and
    every query attends over them through the blocks the first sequence wrote."""
    case = C(heads=(8, 2), qk_norm=True, block_size=16)
    rng = np.random.default_rng(3)
    w = weights(rng, case)
    attn = layer(backend, case, w)
    embed = rng.standard_normal((100, DIM)).astype(F32)  # a token's x is its embedding: equal tokens, equal rows
    prompt_a = rng.integers(0, 100, 40)
    prompt_b = np.concatenate([prompt_a[:35], rng.integers(0, 100, 6)])
    pool = cupaged.BlockPool(16, case.block_size, enable_prefix_caching=True)
    kv = kv_cache(backend, case, 16, num_layers=1)
    attn.forward(backend.asarray(embed[prompt_a]), pool.plan([("a", prompt_a)]), kv, 0)
    assert pool.cached_prefix_len(prompt_b) == 32
    plan = pool.plan([("b", prompt_b)])
    assert (plan.slot_mapping[:32] == -1).all() and (plan.slot_mapping[32:] >= 0).all()
    out = backend.to_numpy(attn.forward(backend.asarray(embed[prompt_b]), plan, kv, 0))
    assert_close(out, reference(case, w, embed[prompt_b]), case.tolerance(), "b")


@pytest.mark.parametrize("cascade", [True, None, False])
def test_a_shared_prompt_is_read_once_through_cascade_attention(backend, monkeypatch, cascade):
    """Eight sequences behind one 70-token prompt (4 shared blocks of 16 once cached), then decode steps: with
    cascade=True the layer reads the shared blocks through cascade_attention, under the rule (None) only from 256
    shared tokens (not here), never with False; every step matches the reference either way."""
    case = C(heads=(8, 2), qk_norm=True, block_size=16, dtype=F16)
    rng = np.random.default_rng(14)
    w = weights(rng, case)
    attn = layer(backend, case, w, cascade=cascade)
    calls = []
    real = cupaged.layers.cascade_attention
    monkeypatch.setattr(cupaged.layers, "cascade_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    embed = rng.standard_normal((64, DIM)).astype(F16)
    prompt = rng.integers(0, 64, 70)
    seqs = {i: np.concatenate([prompt, rng.integers(0, 64, 3 + i)]) for i in range(8)}
    pool = cupaged.BlockPool(64, case.block_size, enable_prefix_caching=True)
    kv = kv_cache(backend, case, 64, num_layers=1)
    attn.forward(backend.asarray(embed[seqs[0]]), pool.plan([(0, seqs[0])]), kv, 0)
    plan = pool.plan([(i, seqs[i]) for i in range(1, 8)])  # prefix hits: 4 blocks each
    attn.forward(backend.asarray(np.concatenate([embed[seqs[i]] for i in range(1, 8)])), plan, kv, 0)
    for step in range(2):
        new = {i: rng.integers(0, 64, 1) for i in range(8)}
        plan = pool.plan_decode(list(range(8)))
        assert plan.shared_prefix_blocks == 4
        out = backend.to_numpy(attn.forward(backend.asarray(np.concatenate([embed[new[i]] for i in range(8)])), plan,
                                            kv, 0))
        for i in range(8):
            seqs[i] = np.concatenate([seqs[i], new[i]])
            assert_close(out[i:i + 1], reference(case, w, embed[seqs[i]])[-1:], case.tolerance(), f"step {step} {i}")
    assert len(calls) == (2 if cascade else 0)


def test_separate_weights_are_fused_on_load(backend):
    case = C(heads=(8, 2), fuse_qkv=True, qk_norm=True)
    rng = np.random.default_rng(4)
    separate = weights(rng, case, fused=False)
    fused = {k: v for k, v in separate.items() if k not in ("wq", "wk", "wv")}
    fused["wqkv"] = np.concatenate([separate["wq"], separate["wk"], separate["wv"]])
    from_separate, from_fused = layer(backend, case, separate), layer(backend, case, fused)
    assert sorted(from_separate.state_dict()) == ["k_norm", "q_norm", "wo", "wqkv"]
    assert np.array_equal(backend.to_numpy(from_separate.state_dict()["wqkv"]), fused["wqkv"])
    x = rng.standard_normal((37, DIM)).astype(F32)
    outs = []
    for attn in (from_separate, from_fused):
        pool, kv = cupaged.BlockPool(8, 16), kv_cache(backend, case, 8, num_layers=1)
        outs.append(backend.to_numpy(attn.forward(backend.asarray(x), pool.plan([("a", 37)]), kv, 0)))
    assert np.array_equal(outs[0], outs[1])
    assert_close(outs[0], reference(case, separate, x), case.tolerance())


# -- full (bidirectional) attention over whole sequences -------------------------------------------------------

FULL_CASES = [
    C(heads=(8, 8), fuse_qkv=True, qk_norm=True, rope="neox"),
    C(heads=(8, 2), rope="gptj"),
    C(heads=(8, 1), qk_norm=True, rope="llama3"),
    C(heads=(8, 2), fuse_qkv=True, rope="partial-gptj", dtype=BF16),
    C(heads=(8, 1), rope=None, dtype=F16),
]


@pytest.mark.parametrize("case", FULL_CASES, ids=[c.id() for c in FULL_CASES])
def test_full_attention_over_whole_sequences(backend, case):
    rng = np.random.default_rng(5)
    w = weights(rng, case)
    attn = layer(backend, case, w, attn_type="full")
    lens = {"a": 37, "b": 5, "c": 1, "d": 70}
    xs = {s: rng.standard_normal((n, DIM)).astype(case.dtype) for s, n in lens.items()}
    pool = cupaged.BlockPool(16, 16)
    out = backend.to_numpy(attn.forward(backend.asarray(np.concatenate(list(xs.values()))),
                                        pool.plan(list(lens.items()))))
    want = np.concatenate([reference(case, w, x, "full") for x in xs.values()])
    assert_close(out, want, case.tolerance())


def test_full_attention_rejects_a_cached_prefix_or_decode():
    case = C(heads=(8, 2))
    attn = layer(_SIM, case, weights(np.random.default_rng(6), case), attn_type="full")
    pool = cupaged.BlockPool(16, 16)
    attn.forward(np.zeros((7, DIM), F32), pool.plan([("a", 5), ("b", 2)]))
    for plan in (pool.plan([("a", 3), ("c", 4)]), pool.plan_decode(["a", "b"])):
        with pytest.raises(ValueError, match="attn_type='full'.*whole sequences"):
            attn.forward(np.zeros((plan.num_tokens, DIM), F32), plan)


# -- cross attention: per-request contexts kept in a ContextCache ----------------------------------------------

CROSS_CASES = [
    C(heads=(8, 8), fuse_qkv=True, qk_norm=True),
    C(heads=(8, 2), context_dim=48),
    C(heads=(8, 1), qk_norm=True, context_dim=96, dtype=BF16),
]


@pytest.mark.parametrize("case", CROSS_CASES, ids=[c.id() for c in CROSS_CASES])
def test_cross_attention_keeps_each_context(backend, case):
    """Step 1 brings a's and b's contexts (lengths 11 and 3); step 2 brings c's (length 29) while a and b read
    theirs from the ContextCache; step 3 is a decode step bringing none. A RoPE given to a cross layer is ignored
    (the reference never rotates cross attention either)."""
    rng = np.random.default_rng(7)
    w = weights(rng, case)
    attn = layer(backend, case, w, attn_type="cross")
    ctx_dim = case.context_dim or DIM
    contexts = {s: rng.standard_normal((n, ctx_dim)).astype(case.dtype) for s, n in (("a", 11), ("b", 3), ("c", 29))}
    store, pool = ContextCache(), cupaged.BlockPool(16, 16)
    steps = [([("a", 37), ("b", 5)], "ab"), ([("a", 1), ("c", 19), ("b", 2)], "c"), (["c", "a", "b"], "")]
    for i, (step, new) in enumerate(steps):
        plan = pool.plan_decode(step) if isinstance(step[0], str) else pool.plan(step)
        batch = [(s, 1) for s in step] if isinstance(step[0], str) else step
        xs = [rng.standard_normal((n, DIM)).astype(case.dtype) for _, n in batch]
        context = {s: backend.asarray(contexts[s]) for s in new} if new else None
        out = backend.to_numpy(attn.forward(backend.asarray(np.concatenate(xs)), plan, store, 0, context=context))
        want = np.concatenate([reference(case, w, x, "cross", contexts[s]) for (s, _), x in zip(batch, xs)])
        assert_close(out, want, case.tolerance(), f"step {i}")
    assert [store.context_len(s) for s in "abc"] == [11, 3, 29]
    # without a store, every sequence brings its context every step
    plan = pool.plan([("a", 2), ("c", 1)])
    x = rng.standard_normal((3, DIM)).astype(case.dtype)
    out = backend.to_numpy(attn.forward(backend.asarray(x), plan, None, 0,
                                        context={s: backend.asarray(contexts[s]) for s in "ac"}))
    want = np.concatenate([reference(case, w, x[:2], "cross", contexts["a"]),
                           reference(case, w, x[2:], "cross", contexts["c"])])
    assert_close(out, want, case.tolerance(), "no store")


def test_cross_attention_without_a_context_raises_and_keeps_nothing():
    case = C(heads=(8, 2))
    rng = np.random.default_rng(8)
    attn = layer(_SIM, case, weights(rng, case), attn_type="cross")
    store, pool = ContextCache(), cupaged.BlockPool(16, 16)
    ctx = {"a": rng.standard_normal((4, DIM)).astype(F32)}
    attn.forward(np.zeros((3, DIM), F32), pool.plan([("a", 3)]), store, 0, context=ctx)
    plan = pool.plan([("a", 1), ("d", 2)])
    x = np.zeros((3, DIM), F32)
    with pytest.raises(ValueError, match="sequence 'd' brings no context"):
        attn.forward(x, plan, store, 0)
    with pytest.raises(ValueError, match="sequence 'a' brings no context and none is kept for layer 1"):
        attn.forward(x, plan, store, 1, context={"d": ctx["a"]})  # a's context is kept for layer 0 only
    with pytest.raises(ValueError, match="sequence 'a' brings no context"):
        attn.forward(x, plan, None, 0, context={"d": ctx["a"]})
    with pytest.raises(ValueError, match=r"context\['e'\]: no such sequence"):
        attn.forward(x, plan, store, 0, context={"d": ctx["a"], "e": ctx["a"]})
    with pytest.raises(ValueError, match=r"context\['d'\] must be a \[context_len, 64\] float32"):
        attn.forward(x, plan, store, 0, context={"d": ctx["a"][:, :10]})
    with pytest.raises(ValueError, match=r"context\['d'\] must be"):
        attn.forward(x, plan, store, 0, context={"d": ctx["a"].astype(F16)})
    with pytest.raises(ValueError, match="seq_ids is None"):
        attn.forward(x, dataclasses.replace(plan, seq_ids=None), store, 0, context={"d": ctx["a"]})
    with pytest.raises(TypeError, match="query_start_loc must have dtype int32"):
        attn.forward(x, dataclasses.replace(plan, query_start_loc=plan.query_start_loc.astype(np.int64)), store, 0,
                     context={"d": ctx["a"]})
    with pytest.raises(TypeError, match="kv_cache must be a cupaged.layers.ContextCache or None"):
        attn.forward(x, plan, KVCache(1, 16, 16, 2, HEAD_DIM, F32, xp=np), 0, context={"d": ctx["a"]})
    assert ("d", 0) not in store and store.context_len("a") == 4 and store.nbytes == 2 * 4 * 2 * HEAD_DIM * 4


# -- bad input -----------------------------------------------------------------------------------------------

CONSTRUCTOR = {  # id: (args, kwargs, exception, message)
    "n_heads-0": ((0, 1, 64), {}, ValueError, "n_heads must be >= 1"),
    "n_heads-float": ((8.0, 1, 64), {}, TypeError, "n_heads must be an int"),
    "gqa-8-3": ((8, 3, 64), {}, ValueError, "n_heads=8 must be a multiple of n_kv_heads=3"),
    "n_kv_heads-0": ((8, 0, 64), {}, ValueError, "n_kv_heads must be >= 1"),
    "dim-0": ((8, 2, 0), {}, ValueError, "dim must be >= 1"),
    "dim-below-n_heads": ((8, 2, 4), {}, ValueError, "head_dim: dim=4 // n_heads=8 is 0"),
    "head_dim-0": ((8, 2, 64), {"head_dim": 0}, ValueError, "head_dim must be >= 1"),
    "context_dim-negative": ((8, 2, 64), {"context_dim": -1}, ValueError, "context_dim must be >= 1"),
    "fuse_qkv-str": ((8, 2, 64), {"fuse_qkv": "yes"}, TypeError, "fuse_qkv must be a bool"),
    "qk_norm-None": ((8, 2, 64), {"use_qk_normalization": None}, TypeError, "use_qk_normalization must be a bool"),
    "norm_eps-0": ((8, 2, 64), {"norm_eps": 0.0}, ValueError, "norm_eps"),
    "attn_type": ((8, 2, 64), {"attn_type": "causal"}, ValueError, "attn_type must be one of 'self', 'full', 'cross'"),
    "rope-str": ((8, 2, 64), {"rope": "neox"}, TypeError, "rope must be a cupaged.RotaryEmbedding or None"),
    "rope-head_dim": ((8, 2, 64), {"rope": cupaged.RotaryEmbedding(64)}, ValueError,
                      "rope is for head_dim=64, the layer's head_dim is 8"),
    "dtype-float64": ((8, 2, 64), {"dtype": np.float64}, TypeError, "dtype must be float32, float16 or bfloat16"),
    "dtype-unknown": ((8, 2, 64), {"dtype": "float8"}, TypeError, "dtype must be float32, float16 or bfloat16"),
    "fused-cross-context_dim": ((8, 2, 64), {"fuse_qkv": True, "context_dim": 32, "attn_type": "cross"}, ValueError,
                                "fuse_qkv needs context_dim == dim"),
}


@pytest.mark.parametrize("args, kwargs, exc, match", CONSTRUCTOR.values(), ids=list(CONSTRUCTOR))
def test_constructor_arguments_are_checked(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Attention(*args, **kwargs)


def test_load_state_dict_checks_every_key_and_shape_before_keeping_any():
    case = C(heads=(8, 2), qk_norm=True)
    rng = np.random.default_rng(9)
    good = weights(rng, case)
    attn = layer(_SIM, case, good)
    bad = [({k: v for k, v in good.items() if k != "k_norm"}, KeyError, r"missing \['k_norm'\], unexpected \[\]"),
           ({**good, "bias": good["wo"]}, KeyError, r"unexpected \['bias'\]"),
           ({**good, "wqkv": good["wq"]}, KeyError, r"unexpected \['wqkv'\]"),
           ({**good, "wo": good["wo"].T}, ValueError, r"wo must have shape \[64, 512\], got \(512, 64\)"),
           ({**good, "k_norm": good["k_norm"][:-1]}, ValueError, r"k_norm must have shape \[64\]"),
           ({**good, "wq": good["wq"].tolist()}, TypeError, "wq must be a numpy or cupy array")]
    for state, exc, match in bad:
        with pytest.raises(exc, match=match):
            attn.load_state_dict(state)
        assert all(np.array_equal(attn.weights[k], good[k]) for k in good)  # the old weights stay
    fused = layer(_SIM, C(heads=(8, 2), fuse_qkv=True), weights(rng, C(heads=(8, 2), fuse_qkv=True)))
    separate = weights(rng, C(heads=(8, 2)))
    with pytest.raises(ValueError, match=r"wk must have shape \[128, 64\]"):
        fused.load_state_dict({**separate, "wk": separate["wq"]})
    with pytest.raises(KeyError, match=r"missing \['wqkv'\], unexpected \['wk', 'wq'\]"):
        fused.load_state_dict({k: v for k, v in separate.items() if k != "wv"})


def test_forward_before_load_state_dict():
    with pytest.raises(RuntimeError, match="call load_state_dict first"):
        Attention(8, 2, DIM, head_dim=HEAD_DIM).forward(np.zeros((1, DIM), F32), cupaged.BlockPool(4, 16).plan(
            [("a", 1)]), KVCache(1, 4, 16, 2, HEAD_DIM, F32, xp=np))


def _bad_forward_calls(pool, kv):
    """(call's changes to (x, plan, kv_cache, layer), exception, message): each must fail before any write."""
    plan = pool.plan([("a", 5), ("b", 1)])
    x = np.ones((6, DIM), F32)

    def other(**kw):
        return KVCache(**{**dict(num_layers=2, num_blocks=16, block_size=16, num_kv_heads=2, head_size=HEAD_DIM,
                                 dtype=F32, xp=np), **kw})

    return [
        ((x[:, :-1], plan, kv, 0), ValueError, r"x must be \[num_tokens, dim=64\], got shape \(6, 63\)"),
        ((x[None], plan, kv, 0), ValueError, r"x must be \[num_tokens, dim=64\]"),
        ((x.astype(F16), plan, kv, 0), TypeError, "x must have the layer's dtype float32, got float16"),
        ((x.tolist(), plan, kv, 0), TypeError, "x must be a numpy or cupy array"),
        ((x[:5], plan, kv, 0), ValueError, "x has 5 tokens, plan has 6"),
        ((x, None, kv, 0), TypeError, "plan must be a cupaged.BatchPlan, got NoneType"),
        ((x, plan, None, 0), TypeError, "kv_cache must be a cupaged.KVCache for attn_type='self', got NoneType"),
        ((x, plan, ContextCache(), 0), TypeError, "kv_cache must be a cupaged.KVCache"),
        ((x, plan, kv, 2), ValueError, "layer must be <= 1, got 2"),
        ((x, plan, kv, -1), ValueError, "layer must be >= 0, got -1"),
        ((x, plan, kv, True), TypeError, "layer must be an int"),
        ((x, plan, other(num_kv_heads=1), 0), ValueError, "kv_cache holds 1 kv heads of 64 in float32; the layer "
                                                          "has 2 of 64"),
        ((x, plan, other(head_size=32), 0), ValueError, "kv_cache holds 2 kv heads of 32"),
        ((x, plan, other(dtype=F16), 0), ValueError, "kv_cache holds 2 kv heads of 64 in float16"),
        ((x, plan, other(layout="vllm"), 0), NotImplementedError, "kv_cache.layout='vllm'"),
        ((x, plan, kv, 0, {"a": x}), ValueError, "context is cross attention's; this layer's attn_type is 'self'"),
        ((x, plan, other(block_size=32), 0), ValueError, "kv_cache has blocks of 32 tokens; plan's pool has blocks "
                                                         "of 16"),
    ]


@pytest.mark.parametrize("rope", [None, "neox"])
def test_a_failed_forward_names_the_argument_and_leaves_the_cache_as_it_was(rope):
    case = C(heads=(8, 2), rope=rope)
    attn = layer(_SIM, case, weights(np.random.default_rng(10), case))
    pool, kv = cupaged.BlockPool(16, 16), kv_cache(_SIM, case, 16)
    attn.forward(np.ones((3, DIM), F32), pool.plan([("a", 2), ("b", 1)]), kv, 1)
    before = cache_bytes(kv, _SIM)
    for args, exc, match in _bad_forward_calls(pool, kv):
        with pytest.raises(exc, match=match):
            attn.forward(*args)
        after = cache_bytes(kv, _SIM)
        assert all(np.array_equal(b, a) for b, a in zip(before, after)), match


HAND_MADE = {  # id: (field, its bad value from the pool's plan)
    "block_tables-int64": ("block_tables", lambda p: p.block_tables.astype(np.int64)),
    "seq_lens-int64": ("seq_lens", lambda p: p.seq_lens.astype(np.int64)),
    "query_start_loc-int64": ("query_start_loc", lambda p: p.query_start_loc.astype(np.int64)),
    "block_tables-1d": ("block_tables", lambda p: p.block_tables[0]),
    "query_start_loc-short": ("query_start_loc", lambda p: p.query_start_loc[:-1]),
    "seq_lens-short": ("seq_lens", lambda p: p.seq_lens[:-1]),
}


@pytest.mark.parametrize("field, bad", HAND_MADE.values(), ids=list(HAND_MADE))
def test_a_hand_made_plan_is_checked_before_any_write(field, bad):
    """A BatchPlan made by hand (the layer takes any) with an index array of the wrong dtype or length: an
    error naming the array before the cache write, as the attention ops check theirs before planning
    (run_attention itself checks nothing beyond the plan)."""
    case = C(heads=(8, 2))
    attn = layer(_SIM, case, weights(np.random.default_rng(14), case))
    pool, kv = cupaged.BlockPool(16, 16), kv_cache(_SIM, case, 16)
    plan = pool.plan([("a", 5), ("b", 1)])
    before = cache_bytes(kv, _SIM)
    with pytest.raises((TypeError, ValueError), match=field):
        attn.forward(np.ones((6, DIM), F32), dataclasses.replace(plan, **{field: bad(plan)}), kv, 0)
    assert all(np.array_equal(b, a) for b, a in zip(before, cache_bytes(kv, _SIM))), "the cache was written"


@pytest.mark.parametrize("attn_type", ["self", "full", "cross"])
def test_a_head_dim_the_kernels_lack_is_a_clear_error(attn_type):
    with pytest.raises(NotImplementedError, match="head_dim=320"):  # past the kernels' largest head size (256)
        Attention(2, 1, DIM, head_dim=320, attn_type=attn_type)


def test_plan_attention_names_a_head_size_past_the_buckets():
    """Regression: plan_attention raised a bare StopIteration for head sizes past 256 (the layer reached it)."""
    q = np.ones((3, 2, 320), F32)
    cu = np.array([0, 3], np.int32)
    with pytest.raises(NotImplementedError, match="head.size.{0,3}320"):
        cupaged.plan_attention(q, cupaged.KvView.dense(np.ones((3, 1, 320), F32), np.ones((3, 1, 320), F32)), None,
                               cu, cu)


def test_slots_outside_the_cache_are_caught_under_validate(monkeypatch):
    """A KVCache smaller than the pool whose plan it runs: with CUPAGED_VALIDATE=1, a ValueError before any
    write (without it, the cache write runs out of bounds: a fault on the sim)."""
    monkeypatch.setenv("CUPAGED_VALIDATE", "1")
    case = C(heads=(8, 2))
    attn = layer(_SIM, case, weights(np.random.default_rng(11), case))
    pool, kv = cupaged.BlockPool(16, 16), kv_cache(_SIM, case, 2)
    pool.append("other", 40)  # "a" gets blocks 3 and up
    before = cache_bytes(kv, _SIM)
    with pytest.raises(ValueError, match=r"block_tables\[0\] holds block id 4, outside the pool of 2 blocks"):
        attn.forward(np.ones((20, DIM), F32), pool.plan([("a", 20)]), kv, 0)
    assert all(np.array_equal(b, a) for b, a in zip(before, cache_bytes(kv, _SIM)))


def test_an_empty_step_checks_its_arguments_too():
    """A step with no tokens runs no kernel, but its bad kv_cache or layer is still an error: a serving loop
    must not learn of it only on its first non-empty step."""
    case = C(heads=(8, 2))
    attn = layer(_SIM, case, weights(np.random.default_rng(12), case))
    pool, kv = cupaged.BlockPool(16, 16), kv_cache(_SIM, case, 16)
    x, plan = np.zeros((0, DIM), F32), pool.plan([])
    assert attn.forward(x, plan, kv, 1).shape == (0, DIM)
    with pytest.raises(TypeError, match="kv_cache must be a cupaged.KVCache"):
        attn.forward(x, plan, None, 0)
    with pytest.raises(ValueError, match="layer must be <= 1"):
        attn.forward(x, plan, kv, 2)


def test_rope_variants_and_options_change_the_reference():
    """The cases above can tell the options apart: at their positions every RoPE variant (and QK-norm) changes
    the reference output by far more than the float32 tolerance."""
    rng = np.random.default_rng(13)
    case = C(heads=(8, 2), qk_norm=True)
    w, x = weights(rng, case), rng.standard_normal((80, DIM))
    outs = {name: reference(dataclasses.replace(case, rope=name), w, x) for name in ROPES}
    outs["no-qk-norm"] = reference(case, {k: v for k, v in w.items() if "norm" not in k}, x)
    for (a, out_a), (b, out_b) in itertools.combinations(outs.items(), 2):
        assert compare(out_a, out_b, F32).failures > out_a.size // 10, (a, b)


def _twelve_and_eight(case, seed):
    """A layer, a 16-block pool and cache, and the pool's plan of sequences "a" (12 tokens) and "b" (8)."""
    attn = layer(_SIM, case, weights(np.random.default_rng(seed), case))
    pool, kv = cupaged.BlockPool(16, 16), kv_cache(_SIM, case, 16)
    return attn, kv, pool.plan([("a", 12), ("b", 8)]), np.ones((20, DIM), F32)


def _with(p, field, index, value):
    a = getattr(p, field).copy()
    a[index] = value
    return {field: a}


BAD_CONTENTS = {  # id: (the plan's bad fields from the pool's plan of "a" (12 tokens) and "b" (8), message)
    "query_start_loc-disagrees-with-seq_lens": (
        lambda p: {"query_start_loc": np.array([0, 13, 20], np.int32)},
        r"q_len <= seq_len \(query_start_loc against seq_lens\): sequence 0 has 13 queries and seq_lens\[0\] = 12"),
    "query_start_loc-not-from-0": (lambda p: _with(p, "query_start_loc", 0, 1), "query_start_loc must start at 0"),
    "query_start_loc-decreasing": (lambda p: _with(p, "query_start_loc", 1, 21), "query_start_loc .*non-decreasing"),
    "query_start_loc-short-of-the-tokens": (lambda p: _with(p, "query_start_loc", 2, 19),
                                            "query_start_loc .*end at 20"),
    "block_tables-outside-the-cache": (lambda p: _with(p, "block_tables", (1, 0), 16),
                                       r"block_tables\[1\] holds block id 16, outside the pool of 16 blocks"),
    "seq_lens-past-the-table": (lambda p: {**_with(p, "seq_lens", 0, 17), "max_seq_len": 17},
                                r"seq_lens\[0\] = 17 needs 2 blocks, but block_tables has 1 columns"),
    "max_seq_len-understated": (lambda p: {"max_seq_len": 11}, r"max_seq_len=11 understates seq_lens\[0\]"),
    "slot_mapping-outside-the-cache": (lambda p: _with(p, "slot_mapping", 5, 256),
                                       r"slot_mapping\[5\] = 256 is outside the pool"),
    "positions-negative": (lambda p: _with(p, "positions", 3, -1), r"plan.positions\[3\] = -1"),
    "positions-past-the-rope-cache": (lambda p: _with(p, "positions", 14, 16), r"plan.positions\[14\] = 16"),
}


@pytest.mark.parametrize("how", ["validate=True", "CUPAGED_VALIDATE=1"])
@pytest.mark.parametrize("bad, match", BAD_CONTENTS.values(), ids=list(BAD_CONTENTS))
def test_validate_checks_a_plans_contents_before_any_write(bad, match, how, monkeypatch):
    """A regression: query_start_loc [0, 13, 20] for seq_lens [12, 8] gave an output off by several units even
    under CUPAGED_VALIDATE=1 (the layer's attention checks nothing of the contents). Under validate every content
    error of the plan is a ValueError naming the array, and the cache is byte-identical afterwards."""
    monkeypatch.delenv("CUPAGED_VALIDATE", raising=False)
    kwargs = {"validate": True}
    if how == "CUPAGED_VALIDATE=1":
        monkeypatch.setenv("CUPAGED_VALIDATE", "1")
        kwargs = {}
    attn, kv, plan, x = _twelve_and_eight(C(heads=(8, 2)), 15)
    before = cache_bytes(kv, _SIM)
    with pytest.raises(ValueError, match=match):
        attn.forward(x, dataclasses.replace(plan, **bad(plan)), kv, 1, **kwargs)
    assert all(np.array_equal(b, a) for b, a in zip(before, cache_bytes(kv, _SIM))), "the cache was written"


def test_validate_is_a_keyword_only_bool():
    attn, kv, plan, x = _twelve_and_eight(C(heads=(8, 2)), 16)
    with pytest.raises(TypeError, match="validate must be a bool"):
        attn.forward(x, plan, kv, 0, validate="yes")
    with pytest.raises(TypeError):
        attn.forward(x, plan, kv, 0, None, True)


@pytest.mark.parametrize("position", [-1, 16, 1 << 40])
def test_a_host_plans_positions_past_the_rope_cache_raise_on_the_default_path(position, monkeypatch):
    """A host plan's positions are on the host: without validate too, one outside what the layer's cos / sin cache
    covers (here "a"'s table holds 16 positions) is a ValueError naming it, never a silent read past the cache."""
    monkeypatch.delenv("CUPAGED_VALIDATE", raising=False)
    attn, kv, plan, x = _twelve_and_eight(C(heads=(8, 2)), 17)
    before = cache_bytes(kv, _SIM)
    with pytest.raises(ValueError, match=rf"plan.positions\[3\] = {position} is outside"):
        attn.forward(x, dataclasses.replace(plan, **_with(plan, "positions", 3, position)), kv, 0)
    assert all(np.array_equal(b, a) for b, a in zip(before, cache_bytes(kv, _SIM))), "the cache was written"


def test_an_understated_max_seq_len_hint_never_reads_past_the_rope_cache(monkeypatch):
    """The cos / sin cache grew to the max_seq_len hint only: a plan of 80 tokens hinting 16 read rows 64..79 past
    its 64 (a fault on the sim, silent on a GPU). It now covers what the block tables hold, and the keys written
    are those of the same plan with the true hint."""
    monkeypatch.delenv("CUPAGED_VALIDATE", raising=False)
    case = C(heads=(8, 2))
    w = weights(np.random.default_rng(18), case)
    x = np.random.default_rng(19).standard_normal((80, DIM)).astype(F32)
    written = []
    for hint in (80, 16):
        pool, kv = cupaged.BlockPool(8, 16), kv_cache(_SIM, case, 8)
        plan = pool.plan([("a", 80)])
        layer(_SIM, case, w).forward(x, dataclasses.replace(plan, max_seq_len=hint), kv, 0)
        written.append(cache_bytes(kv, _SIM))
    assert all(np.array_equal(a, b) for a, b in zip(*written))


@pytest.mark.parametrize("attn_type", ["full", "cross"])
def test_validate_checks_the_plan_of_full_and_cross_attention_too(attn_type):
    case = C(heads=(8, 2))
    attn = layer(_SIM, case, weights(np.random.default_rng(20), case), attn_type)
    plan = cupaged.BlockPool(16, 16).plan([("a", 12), ("b", 8)])
    bad = dataclasses.replace(plan, query_start_loc=np.array([0, 13, 20], np.int32))
    store = ContextCache()
    context = {"a": np.ones((3, DIM), F32), "b": np.ones((2, DIM), F32)} if attn_type == "cross" else None
    with pytest.raises(ValueError, match=r"sequence 0 has 13 queries and seq_lens\[0\] = 12"):
        attn.forward(np.ones((20, DIM), F32), bad, store, 0, context, validate=True)
    assert not store.nbytes


# -- the model families' options: biases, scale, softcap, windows, sinks, ALiBi, QK norms, RoPE scalings -------
# The reference runs each sequence step by step with its own DenseCache (input_pos = the tokens it has seen), as
# Hugging Face runs one sequence: a scaling whose frequencies follow the sequence's length (dynamic NTK, LongRoPE)
# rotates each step's keys with that step's frequencies, and the cache keeps them so.

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False}  # gpt-oss's form, with a short original context
OPT_ROPES = {
    None: None,
    "neox": {},
    "yarn": {"rope_theta": 150000.0, "scaling": YARN, "max_position_embeddings": 128},
    "linear": {"scaling": {"rope_type": "linear", "factor": 2.0}},
    "dynamic": {"scaling": {"type": "dynamic", "factor": 2.0}, "max_position_embeddings": 48},  # legacy "type"
    "longrope": {"rotary_dim": 32, "scaling": {"rope_type": "longrope", "short_factor": list(np.linspace(1, 1.5, 16)),
                                                "long_factor": list(np.linspace(1, 6, 16)),
                                                "original_max_position_embeddings": 48},
                 "max_position_embeddings": 192},
    "llama3-gptj": {"is_neox_style": False, "rope_theta": 500000.0,
                    "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}},
}


@dataclasses.dataclass
class Opt:
    heads: tuple = (8, 2)
    options: dict = dataclasses.field(default_factory=dict)  # Attention's keyword options
    rope: str | None = "neox"
    dtype: type = F32
    fuse_qkv: bool = False
    per_head_norm: bool = False  # "layer_head" with Cohere's weight per head

    def id(self):
        opts = "-".join(f"{k}{'' if v is True else v}" for k, v in self.options.items()) or "plain"
        return f"h{self.heads[0]}-{self.heads[1]}-{opts}-rope-{self.rope}-{np.dtype(self.dtype).name}" + \
            ("-fused" if self.fuse_qkv else "")

    def tolerance(self):
        atol, rtol = TOLERANCES[np.dtype(self.dtype)]
        return (atol, rtol) if np.dtype(self.dtype) == F32 else (ROUNDINGS * atol, ROUNDINGS * rtol)


def opt_rotary(case: Opt):
    kwargs = OPT_ROPES[case.rope]
    return None if kwargs is None else cupaged.RotaryEmbedding(HEAD_DIM, **kwargs)


def opt_weights(rng, case: Opt):
    (nh, nkv), o = case.heads, case.options
    w = {"wq": rng.standard_normal((nh * HEAD_DIM, DIM)), "wk": rng.standard_normal((nkv * HEAD_DIM, DIM)),
         "wv": rng.standard_normal((nkv * HEAD_DIM, DIM)), "wo": rng.standard_normal((DIM, nh * HEAD_DIM))}
    w = {k: v / np.sqrt(v.shape[1]) for k, v in w.items()}
    if o.get("bias"):
        w.update({f"b{n}": 0.5 * rng.standard_normal(w[f"w{n}"].shape[0]) for n in "qkvo"})
    norm = o.get("qk_norm")
    if norm in ("rms_head", "layer_head"):
        shapes = ((nh, HEAD_DIM), (nkv, HEAD_DIM)) if case.per_head_norm else ((HEAD_DIM,), (HEAD_DIM,))
        w["q_norm"], w["k_norm"] = (1 + 0.2 * rng.standard_normal(s) for s in shapes)
    elif norm == "rms_all_heads":
        w["q_norm"], w["k_norm"] = (1 + 0.2 * rng.standard_normal(n * HEAD_DIM) for n in (nh, nkv))
    if o.get("sinks"):
        w["sinks"] = rng.standard_normal(nh) + 1.0
    w = {k: v.astype(F32 if k == "sinks" else case.dtype) for k, v in w.items()}
    if case.fuse_qkv:
        w["wqkv"] = np.concatenate([w.pop("wq"), w.pop("wk"), w.pop("wv")])
        if o.get("bias"):
            w["bqkv"] = np.concatenate([w.pop("bq"), w.pop("bk"), w.pop("bv")])
    return w


def make_layer(backend, case: Opt, w, attn_type="self"):
    nh, nkv = case.heads
    attn = Attention(nh, nkv, DIM, head_dim=HEAD_DIM, fuse_qkv=case.fuse_qkv, attn_type=attn_type,
                     rope=opt_rotary(case), dtype=case.dtype, **case.options)
    attn.load_state_dict({k: backend.asarray(v) for k, v in w.items()})
    return attn


def ref_options(case: Opt) -> dict:
    return {k: v for k, v in case.options.items() if k in ("scale", "softcap", "sliding_window", "alibi", "qk_norm")}


def run_option_steps(backend, case: Opt, seed=0):
    """SELF_STEPS through the layer and a paged cache; the reference steps each sequence through its own cache."""
    rng = np.random.default_rng(seed)
    w = opt_weights(rng, case)
    attn = make_layer(backend, case, w)
    history = {s: rng.standard_normal((80, DIM)).astype(case.dtype) for s in "abcx"}
    pool, kv = cupaged.BlockPool(24, 16), cupaged.KVCache(1, 24, 16, case.heads[1], HEAD_DIM, case.dtype,
                                                          xp=backend.xp)
    caches = {s: ref.DenseCache(case.heads[1], 80, HEAD_DIM) for s in "abcx"}
    lens = dict.fromkeys("abcx", 0)
    for i, step in enumerate(SELF_STEPS):
        decode = isinstance(step[0], str)
        plan, new = (pool.plan_decode(list(step)), [(s, 1) for s in step]) if decode else (pool.plan(step), step)
        x = np.concatenate([history[s][lens[s]:lens[s] + n] for s, n in new])
        out = backend.to_numpy(attn.forward(backend.asarray(x), plan, kv, 0))
        start = 0
        for s, n in new:
            want = ref.attention(w, history[s][lens[s]:lens[s] + n], n_heads=case.heads[0], n_kv_heads=case.heads[1],
                                 head_dim=HEAD_DIM, rope=opt_rotary(case), cache=caches[s], input_pos=lens[s],
                                 **ref_options(case))
            assert_close(out[start:start + n], want, case.tolerance(), f"step {i} {s}")
            start, lens[s] = start + n, lens[s] + n
        if "x" in pool:
            pool.free("x")


O = Opt
CASES = [
    O(options={"bias": True}, fuse_qkv=True),  # Qwen2 / gpt-oss biases through wqkv + bqkv
    O(options={"bias": True}, dtype=BF16),
    O(heads=(8, 8), options={"scale": 0.3, "softcap": 5.0}),  # Gemma's query_pre_attn_scalar and softcap
    O(options={"sliding_window": 7}, rope="llama3-gptj"),  # Mistral's window, shorter than a prefill chunk
    O(heads=(8, 1), options={"sinks": True}, dtype=F16),
    O(heads=(8, 8), options={"alibi": True}, rope=None),  # Bloom / MPT
    O(heads=(8, 2), options={"alibi": True, "softcap": 3.0}, rope=None, dtype=BF16),
    O(options={"qk_norm": "layer_head"}),
    O(options={"qk_norm": "layer_head"}, per_head_norm=True),  # Cohere's per-head weights
    O(options={"qk_norm": "rms_all_heads"}, fuse_qkv=True),  # OLMo 2
    O(heads=(8, 1), options={"qk_norm": "l2"}, rope="yarn"),  # Llama 4
    O(options={"qk_norm": "rms_head"}, rope="linear", dtype=F16),
    O(options={"sinks": True, "sliding_window": 16, "bias": True}, rope="yarn", dtype=BF16),  # gpt-oss
    O(rope="dynamic"),
    O(heads=(8, 1), rope="longrope", dtype=F16),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_each_option_over_mixed_steps(backend, case):
    run_option_steps(backend, case)


def test_alibi_takes_the_slopes_given():
    case = O(heads=(8, 2), options={"alibi": np.linspace(0.05, 0.9, 8)}, rope=None)
    run_option_steps(_SIM, case, seed=3)


def test_gemma2_like_alternating_stack(backend):
    """Two layers as Gemma 2 alternates them (a local one with a window of 12, a global one), both soft-capped with
    Gemma's scale, over one KVCache of two layers: layer 1 reads layer 0's output plus the residual."""
    rng = np.random.default_rng(11)
    common = {"scale": 24 ** -0.5, "softcap": 50.0, "qk_norm": None}
    cases = [O(heads=(8, 4), options={**common, "sliding_window": 12}, dtype=BF16),
             O(heads=(8, 4), options=common, dtype=BF16)]
    ws = [opt_weights(rng, c) for c in cases]
    layers = [make_layer(backend, c, w) for c, w in zip(cases, ws)]
    history = {s: rng.standard_normal((80, DIM)).astype(BF16) for s in "abcx"}
    pool, kv = cupaged.BlockPool(24, 16), cupaged.KVCache(2, 24, 16, 4, HEAD_DIM, BF16, xp=backend.xp)
    caches = [{s: ref.DenseCache(4, 80, HEAD_DIM) for s in "abcx"} for _ in cases]
    lens = dict.fromkeys("abcx", 0)
    for i, step in enumerate(SELF_STEPS):
        decode = isinstance(step[0], str)
        plan, new = (pool.plan_decode(list(step)), [(s, 1) for s in step]) if decode else (pool.plan(step), step)
        x = np.concatenate([history[s][lens[s]:lens[s] + n] for s, n in new])
        for li, (case, w, attn) in enumerate(zip(cases, ws, layers)):
            out = backend.to_numpy(attn.forward(backend.asarray(x), plan, kv, li))
            start = 0
            for s, n in new:
                want = ref.attention(w, x[start:start + n], n_heads=8, n_kv_heads=4, head_dim=HEAD_DIM,
                                     rope=opt_rotary(case), cache=caches[li][s], input_pos=lens[s], **ref_options(case))
                assert_close(out[start:start + n], want, case.tolerance(), f"step {i} layer {li} {s}")
                start += n
            x = (x.astype(F32) + out.astype(F32)).astype(BF16)  # the residual stream into the next layer
        for s, n in new:
            lens[s] += n
        if "x" in pool:
            pool.free("x")


FULL_CROSS = [
    (O(heads=(8, 2), options={"alibi": True, "softcap": 4.0, "sinks": True, "bias": True}), "full"),
    (O(heads=(8, 8), options={"qk_norm": "rms_all_heads", "scale": 0.2}, rope="dynamic"), "full"),
    (O(heads=(8, 2), options={"bias": True, "sinks": True, "qk_norm": "layer_head"}, rope=None, dtype=F16), "cross"),
]


@pytest.mark.parametrize("case, attn_type", FULL_CROSS, ids=[f"{t}-{c.id()}" for c, t in FULL_CROSS])
def test_full_and_cross_attention_take_the_options(backend, case, attn_type):
    rng = np.random.default_rng(12)
    w = opt_weights(rng, case)
    attn = make_layer(backend, case, w, attn_type)
    lens = {"a": 37, "b": 5, "c": 70}
    xs = {s: rng.standard_normal((n, DIM)).astype(case.dtype) for s, n in lens.items()}
    ctx = {s: rng.standard_normal((n, DIM)).astype(case.dtype) for s, n in (("a", 9), ("b", 2), ("c", 30))}
    kw = {"context": {s: backend.asarray(c) for s, c in ctx.items()}} if attn_type == "cross" else {}
    out = backend.to_numpy(attn.forward(backend.asarray(np.concatenate(list(xs.values()))),
                                        cupaged.BlockPool(16, 16).plan(list(lens.items())), None, 0, **kw))
    want = np.concatenate([ref.attention(w, x, n_heads=case.heads[0], n_kv_heads=case.heads[1], head_dim=HEAD_DIM,
                                         attn_type=attn_type, rope=opt_rotary(case), context=ctx[s],
                                         **ref_options(case)) for s, x in xs.items()])
    assert_close(out, want, case.tolerance())


BAD = {  # id: (kwargs, exception, message)
    "window-negative": ({"sliding_window": -4}, ValueError, "sliding_window must be >= 1"),
    "window-float": ({"sliding_window": 4.0}, TypeError, "sliding_window must be an int"),
    "window-full": ({"sliding_window": 4, "attn_type": "full"}, NotImplementedError, "sliding_window"),
    "softcap-inf": ({"softcap": float("inf")}, ValueError, "softcap"),
    "softcap-negative": ({"softcap": -1.0}, ValueError, "softcap"),
    "scale-nan": ({"scale": float("nan")}, ValueError, "scale"),
    "scale-0": ({"scale": 0.0}, ValueError, "scale"),
    "alibi-length": ({"alibi": np.ones(3)}, ValueError, "alibi must hold n_heads=8 slopes"),
    "alibi-nan": ({"alibi": np.full(8, np.nan)}, ValueError, "alibi slopes must be finite"),
    "alibi-cross": ({"alibi": True, "attn_type": "cross"}, NotImplementedError, "alibi"),
    "qk_norm-unknown": ({"qk_norm": "rms"}, ValueError, "qk_norm must be None or one of"),
    "qk_norm-conflict": ({"qk_norm": "l2", "use_qk_normalization": True}, ValueError, "use_qk_normalization"),
    "bias-str": ({"bias": "yes"}, TypeError, "bias must be a bool"),
    "sinks-str": ({"sinks": "yes"}, TypeError, "sinks must be a bool"),
}


@pytest.mark.parametrize("kwargs, exc, match", BAD.values(), ids=list(BAD))
def test_bad_options_are_named(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Attention(8, 2, DIM, head_dim=HEAD_DIM, **kwargs)


def test_bad_option_weights_are_named_and_nothing_is_kept():
    case = O(options={"bias": True, "sinks": True, "qk_norm": "layer_head"})
    rng = np.random.default_rng(13)
    good = opt_weights(rng, case)
    attn = make_layer(_SIM, case, good)
    no_bo = {k: v for k, v in good.items() if k != "bo"}
    assert sorted(make_layer(_SIM, case, no_bo).weights) == sorted(no_bo)  # a missing bo means zero
    bad = [({**good, "bq": good["bq"][:-1]}, ValueError, r"bq must have shape \[512\]"),
           ({**good, "bo": good["bk"]}, ValueError, r"bo must have shape \[64\]"),
           ({k: v for k, v in good.items() if k != "sinks"}, KeyError, r"missing \['sinks'\]"),
           ({**good, "sinks": np.full(8, np.inf, F32)}, ValueError, "sinks must be finite"),
           ({**good, "q_norm": np.ones((2, HEAD_DIM), F32)}, ValueError, r"q_norm must have shape \[64\] or \[8, 64\]"),
           ({**good, "bqkv": np.ones(768, F32)}, KeyError, r"unexpected \['bqkv'\]")]
    for state, exc, match in bad:
        with pytest.raises(exc, match=match):
            attn.load_state_dict(state)
        assert all(np.array_equal(attn.weights[k], good[k]) for k in good)
    plain = make_layer(_SIM, O(), opt_weights(rng, O()))
    with pytest.raises(KeyError, match=r"unexpected \['bq', 'bv'\]"):
        plain.load_state_dict({**opt_weights(rng, O()), "bq": good["bq"], "bv": good["bv"]})


def test_the_default_options_are_todays_layer():
    """No option: scale 1/sqrt(head_dim), no bias key, no cap, window, sinks or ALiBi; use_qk_normalization=True is
    qk_norm 'rms_head'."""
    o = Attention(8, 2, DIM, head_dim=HEAD_DIM, use_qk_normalization=True).options
    assert (o.bias, o.scale, o.softcap, o.sliding_window, o.sinks, o.alibi_slopes, o.qk_norm) == \
        (False, HEAD_DIM ** -0.5, None, None, False, None, "rms_head")
    slopes = Attention(12, 12, 96, alibi=True).options.alibi_slopes
    # Bloom's get_slopes for 12 heads: 8 slopes 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    assert np.array_equal(slopes, np.array([2.0 ** -i for i in range(1, 9)] + [2.0 ** -(i + 0.5) for i in range(4)],
                                           np.float32))


# -- a tree mask: speculative decoding's verify step ---------------------------------------------------------

TREES = {"a": [-1, 0, 1, -1, 3], "b": [-1, -1, 1]}  # each draft node's parent, in topological order (-1: the root)
TREE_CASES = [C(heads=(8, 2), qk_norm=True, rope="neox", block_size=5),
              C(heads=(8, 1), fuse_qkv=True, rope="gptj", dtype=F16, layout="HND")]


def _branch(parents, node):
    """The nodes from the root's first child down to ``node`` (-1: the root, an empty branch)."""
    return _branch(parents, parents[node]) + [node] if node >= 0 else []


@pytest.mark.parametrize("case", TREE_CASES, ids=[c.id() for c in TREE_CASES])
def test_a_tree_mask_attends_each_node_over_its_own_branch(backend, case, monkeypatch):
    """Two forks of one 17-token prompt verify draft trees (the root, their last token, at key index 17, node i at
    18 + i, RoPE position 17 + its depth, a mask showing each node the prompt, its ancestors and itself) beside a
    third fork's causal 11-token chunk, in one step: every row is the float64 reference of plain causal attention
    over its own branch, an independent check of the mask. The forks share the prompt's blocks, which the layer
    (cascade=True) would read through cascade_attention; with a mask it never does."""
    rng = np.random.default_rng(34)
    w = weights(rng, case)
    attn = layer(backend, case, w, cascade=True)
    monkeypatch.setattr(cupaged.layers, "cascade_attention", lambda *a, **k: pytest.fail("cascade with a mask"))
    prompt, chunk = (rng.standard_normal((n, DIM)).astype(case.dtype) for n in (17, 11))
    nodes = {s: rng.standard_normal((1 + len(p), DIM)).astype(case.dtype) for s, p in TREES.items()}  # root first
    pool, kv = cupaged.BlockPool(24, case.block_size), kv_cache(backend, case, 24, num_layers=1)
    attn.forward(backend.asarray(prompt), pool.plan([("a", 17)]), kv, 0)
    pool.fork("a", "b")
    pool.fork("a", "c")
    plan = pool.plan([("a", 6), ("c", 11), ("b", 4)])
    cupaged.copy_blocks(kv.key_caches, kv.value_caches, backend.asarray(pool.take_pending_copies()))
    assert plan.shared_prefix_blocks == 17 // case.block_size
    positions, rows = plan.positions.copy(), [np.tril(np.ones((11, 28), bool), 17)]
    for s, start in (("a", 0), ("b", 17)):
        parents = TREES[s]
        mask = np.zeros((1 + len(parents), 18 + len(parents)), bool)
        mask[:, :18] = True  # the prompt and the root
        for i, p in enumerate(parents):
            mask[1 + i, 18:] = mask[1 + p, 18:]  # parent before child: its row is complete
            mask[1 + i, 18 + i] = True
            positions[start + 1 + i] = 17 + len(_branch(parents, i))
        rows.insert(0 if s == "a" else 2, mask)
    custom_mask = np.concatenate([m.reshape(-1) for m in rows])
    packed, indptr = cupaged.pack_custom_mask(custom_mask, query_start_loc=plan.query_start_loc,
                                              seq_lens=plan.seq_lens)
    tree_plan = dataclasses.replace(plan, positions=positions, custom_mask=packed, mask_indptr=indptr)
    x = np.concatenate([nodes["a"], chunk, nodes["b"]])
    out = backend.to_numpy(attn.forward(backend.asarray(x), tree_plan, kv, 0))
    assert_close(out[6:17], reference(case, w, np.concatenate([prompt, chunk]))[17:], case.tolerance(), "chunk")
    for s, start in (("a", 0), ("b", 17)):
        for node in range(-1, len(TREES[s])):
            branch = nodes[s][[0] + [1 + i for i in _branch(TREES[s], node)]]
            want = reference(case, w, np.concatenate([prompt, branch]))[-1:]
            assert_close(out[start + 1 + node:start + 2 + node], want, case.tolerance(), f"{s} node {node}")


@pytest.mark.parametrize("kwargs, attn_type", [({"sliding_window": 8}, "self"), ({"alibi": True}, "self"),
                                               ({}, "full")], ids=["sliding_window", "alibi", "full"])
def test_a_tree_mask_with_a_window_alibi_or_full_attention_is_not_implemented(kwargs, attn_type):
    """A window and ALiBi measure distances by key index, which in a tree is not the token position; nothing is
    written."""
    case = C(heads=(8, 2))
    attn = layer(_SIM, case, weights(np.random.default_rng(0), case), attn_type, **kwargs)
    pool, kv = cupaged.BlockPool(8, case.block_size), kv_cache(_SIM, case, 8, num_layers=1)
    plan = pool.plan([("a", 3)])
    tree_plan = dataclasses.replace(plan, custom_mask=np.tril(np.ones((3, 3), bool)).reshape(-1))
    before = cache_bytes(kv, _SIM)
    with pytest.raises(NotImplementedError, match="custom_mask"):
        attn.forward(_SIM.asarray(np.ones((3, DIM), F32)), tree_plan, kv, 0)
    assert all(np.array_equal(a, b) for a, b in zip(cache_bytes(kv, _SIM), before))


def test_a_tree_mask_that_shows_a_later_key_is_refused_before_any_write():
    case = C(heads=(8, 2))
    attn = layer(_SIM, case, weights(np.random.default_rng(0), case))
    pool, kv = cupaged.BlockPool(8, case.block_size), kv_cache(_SIM, case, 8, num_layers=1)
    plan = pool.plan([("a", 3)])
    tree_plan = dataclasses.replace(plan, custom_mask=np.ones(9, bool))
    before = cache_bytes(kv, _SIM)
    with pytest.raises(ValueError, match="sees key 1, a later one"):
        attn.forward(_SIM.asarray(np.ones((3, DIM), F32)), tree_plan, kv, 0)
    assert all(np.array_equal(a, b) for a, b in zip(cache_bytes(kv, _SIM), before))
