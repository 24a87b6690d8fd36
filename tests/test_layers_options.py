"""Attention's model-family options (cupaged/layers.py, cupaged/_layer_options.py) against the float64 reference
(cupaged/reference/layers.py), on the sim (and cuda with a GPU): biases, scale, softcap, sliding windows, sinks,
ALiBi, every QK norm and every RoPE scaling, over multi-step batches through a BlockPool and a paged KVCache.

The reference runs each sequence step by step with its own DenseCache (input_pos = the tokens it has seen), as
Hugging Face runs one sequence: a scaling whose frequencies follow the sequence's length (dynamic NTK, LongRoPE)
rotates each step's keys with that step's frequencies, and the cache keeps them so.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cupaged
from cupaged.layers import Attention
from cupaged.reference import layers as ref
from tests.test_layers import BF16, DIM, F16, F32, HEAD_DIM, ROUNDINGS, SELF_STEPS, _SIM
from cupaged.testing import TOLERANCES, assert_close

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False}  # gpt-oss's form, with a short original context
ROPES = {
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


def rotary(case: Opt):
    kwargs = ROPES[case.rope]
    return None if kwargs is None else cupaged.RotaryEmbedding(HEAD_DIM, **kwargs)


def weights(rng, case: Opt):
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
                     rope=rotary(case), dtype=case.dtype, **case.options)
    attn.load_state_dict({k: backend.asarray(v) for k, v in w.items()})
    return attn


def ref_options(case: Opt) -> dict:
    return {k: v for k, v in case.options.items() if k in ("scale", "softcap", "sliding_window", "alibi", "qk_norm")}


def run_steps(backend, case: Opt, seed=0):
    """SELF_STEPS through the layer and a paged cache; the reference steps each sequence through its own cache."""
    rng = np.random.default_rng(seed)
    w = weights(rng, case)
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
                                 head_dim=HEAD_DIM, rope=rotary(case), cache=caches[s], input_pos=lens[s],
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
    run_steps(backend, case)


def test_alibi_takes_the_slopes_given():
    case = O(heads=(8, 2), options={"alibi": np.linspace(0.05, 0.9, 8)}, rope=None)
    run_steps(_SIM, case, seed=3)


def test_gemma2_like_alternating_stack(backend):
    """Two layers as Gemma 2 alternates them (a local one with a window of 12, a global one), both soft-capped with
    Gemma's scale, over one KVCache of two layers: layer 1 reads layer 0's output plus the residual."""
    rng = np.random.default_rng(11)
    common = {"scale": 24 ** -0.5, "softcap": 50.0, "qk_norm": None}
    cases = [O(heads=(8, 4), options={**common, "sliding_window": 12}, dtype=BF16),
             O(heads=(8, 4), options=common, dtype=BF16)]
    ws = [weights(rng, c) for c in cases]
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
                                     rope=rotary(case), cache=caches[li][s], input_pos=lens[s], **ref_options(case))
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
    w = weights(rng, case)
    attn = make_layer(backend, case, w, attn_type)
    lens = {"a": 37, "b": 5, "c": 70}
    xs = {s: rng.standard_normal((n, DIM)).astype(case.dtype) for s, n in lens.items()}
    ctx = {s: rng.standard_normal((n, DIM)).astype(case.dtype) for s, n in (("a", 9), ("b", 2), ("c", 30))}
    kw = {"context": {s: backend.asarray(c) for s, c in ctx.items()}} if attn_type == "cross" else {}
    out = backend.to_numpy(attn.forward(backend.asarray(np.concatenate(list(xs.values()))),
                                        cupaged.BlockPool(16, 16).plan(list(lens.items())), None, 0, **kw))
    want = np.concatenate([ref.attention(w, x, n_heads=case.heads[0], n_kv_heads=case.heads[1], head_dim=HEAD_DIM,
                                         attn_type=attn_type, rope=rotary(case), context=ctx[s], **ref_options(case))
                           for s, x in xs.items()])
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
    good = weights(rng, case)
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
    plain = make_layer(_SIM, O(), weights(rng, O()))
    with pytest.raises(KeyError, match=r"unexpected \['bq', 'bv'\]"):
        plain.load_state_dict({**weights(rng, O()), "bq": good["bq"], "bv": good["bv"]})


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
