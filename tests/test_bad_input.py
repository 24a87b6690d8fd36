"""Inputs every op once accepted and got wrong, or rejected with an unhelpful error. Each is now
a TypeError / ValueError naming the argument before any launch, and nothing is written:
read-only outputs and caches (numpy; they were silently left unwritten), a non-finite
softcap (every output NaN), fp8 scale arrays holding 0, -1 or NaN (checked with validate=True, as
scalars always are), a str or an int for causal, a list for scale, a window past int32, a list for a block
mapping; a scale or softcap that overflows as a float32 once the kernels fold log2(e) in (or rounds to 0), None
or a list for an array, a strided workspace, K/V views of mismatched arrays, workspace_bytes of non-counts;
public classes name their module ``cupaged``."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import sim
from tests.test_mla import UpProjection, latent_pool
from tests.test_paged_attention import C, build
from tests.test_paged_attention_vllm import vllm_inputs

F16 = np.float16


def _paged(**case):
    inputs, options, _ = build(C(seqs=((1, 40), (3, 20)), heads=(4, 2), head_size=64, **case))
    return {k: sim.asarray(v) for k, v in inputs.items()}, options


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _paged_read_only(name):
    args, options = _paged()
    extra = {"out": _read_only(sim.zeros((4, 4, 64), F16)) if name == "out" else None}
    if name == "workspace":
        extra = {"workspace": _read_only(sim.zeros(1 << 16, np.uint8)), "kv_split_size": 8}
    cupaged.paged_attention(**args, **options, **extra)


def _v2_read_only(name):
    inputs, _ = vllm_inputs(C(seqs=((1, 40), (1, 20)), heads=(4, 2), head_size=64))
    bufs = dict(out=np.zeros((2, 4, 64), F16), exp_sums=np.zeros((2, 4, 1), np.float32),
                max_logits=np.zeros((2, 4, 1), np.float32), tmp_output=np.zeros((2, 4, 1, 64), F16))
    bufs[name] = _read_only(bufs[name])
    cupaged.paged_attention_v2(*bufs.values(), inputs["q"], inputs["key_cache"], inputs["value_cache"], 2, 0.125,
                               inputs["block_tables"], inputs["seq_lens"], 16, 40, None)


def _cache_write_read_only(name):
    key = np.ones((3, 2, 64), F16)
    caches = dict(key_cache=np.zeros((4, 16, 2, 64), F16), value_cache=np.zeros((4, 16, 2, 64), F16))
    caches[name] = _read_only(caches[name])
    cupaged.reshape_and_cache_flash(key, key, *caches.values(), np.arange(3, dtype=np.int64))


def _gather_read_only(_):
    cache, table, _ = latent_pool(np.random.default_rng(0), [5], 16, F16, "auto")
    cupaged.gather_and_maybe_dequant_cache(cache, _read_only(np.zeros((5, 576), F16)), table,
                                           np.array([0, 5], np.int32), np.zeros(5, np.int32), 5)


def _copy_blocks_read_only(_):
    cupaged.copy_blocks([_read_only(np.zeros((4, 16, 8), F16))], None, np.array([[0, 1]], np.int64))


READ_ONLY = {
    "paged_attention out": (_paged_read_only, "out"),
    "paged_attention workspace": (_paged_read_only, "workspace"),
    **{f"paged_attention_v2 {n}": (_v2_read_only, n) for n in ("out", "exp_sums", "max_logits", "tmp_output")},
    "reshape_and_cache_flash value_cache": (_cache_write_read_only, "value_cache"),
    "gather dst": (_gather_read_only, "dst"),
    "copy_blocks cache": (_copy_blocks_read_only, "key_caches\\[0\\]"),
}


@pytest.mark.parametrize("case", READ_ONLY, ids=list(READ_ONLY))
def test_read_only_outputs_are_rejected(case):
    call, name = READ_ONLY[case]
    with pytest.raises(ValueError, match=f"{name.split(' ')[-1]} is read-only"):
        call(name.replace("\\", ""))


def test_softcap_inf_is_rejected_and_zero_means_off():
    args, options = _paged()
    with pytest.raises(ValueError, match="softcap"):
        cupaged.paged_attention(**args, **{**options, "softcap": float("inf")})
    off = cupaged.paged_attention(**args, **{**options, "softcap": 0.0})  # FlashAttention's and vLLM's "off"
    assert np.array_equal(off.view(np.uint16), cupaged.paged_attention(**args, **options).view(np.uint16))


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan], ids=["zero", "negative", "nan"])
def test_fp8_scale_arrays_are_checked_under_validate(bad):
    args, options = _paged(kv_cache_dtype="fp8")
    scales = np.array([bad], np.float32)
    for name in ("k_scale", "v_scale"):
        with pytest.raises(ValueError, match=f"{name} must hold finite values > 0"):
            cupaged.paged_attention(**args, **{**options, name: scales}, validate=True)
        with pytest.raises(ValueError, match=name):  # the same value as a scalar: always rejected
            cupaged.paged_attention(**args, **{**options, name: float(bad)})
    key = np.ones((3, 2, 64), F16)
    caches = [sim.zeros((4, 16, 2, 64), np.uint8) for _ in range(2)]
    with pytest.raises(ValueError, match="v_scale must hold"):
        cupaged.reshape_and_cache_flash(key, key, *caches, np.arange(3, dtype=np.int64), "fp8", 1.0, scales,
                                        validate=True)
    assert not any(c.any() for c in caches), "a rejected call wrote the caches"


@pytest.mark.parametrize("bad", [1e39, 1e-46], ids=["inf_as_float32", "zero_as_float32"])
def test_fp8_scalar_scales_must_survive_float32(bad):
    """A scalar scale is passed as a float32: 1e39 became inf (every output inf or NaN), 1e-46 zero."""
    args, options = _paged(kv_cache_dtype="fp8")
    for name in ("k_scale", "v_scale"):
        with pytest.raises(ValueError, match=f"{name} must be a positive float that is finite and not 0 as a float32"):
            cupaged.paged_attention(**args, **{**options, name: bad})
    key = np.ones((3, 2, 64), F16)
    caches = [sim.zeros((4, 16, 2, 64), np.uint8) for _ in range(2)]
    with pytest.raises(ValueError, match="k_scale must be a positive float"):
        cupaged.reshape_and_cache_flash(key, key, *caches, np.arange(3, dtype=np.int64), "fp8", bad, 1.0)
    assert not any(c.any() for c in caches), "a rejected call wrote the caches"


ARGUMENTS = [
    ({"causal": "no"}, TypeError, "causal must be a bool"),
    ({"scale": [0.1]}, TypeError, "scale must be a float"),
    ({"scale": float("nan")}, ValueError, "scale"),
    ({"sliding_window": 2**31}, ValueError, "sliding_window must be <="),
    ({"sliding_window": 1.5}, TypeError, "sliding_window must be an int"),
    ({"kv_split_size": "256"}, TypeError, "kv_split_size"),
    ({"max_query_len": -1}, ValueError, "max_query_len"),
    ({"max_seq_len": 2.0}, TypeError, "max_seq_len"),
    ({"return_lse": None}, TypeError, "return_lse"),
    ({"validate": "yes"}, TypeError, "validate"),
]


@pytest.mark.parametrize("change, exc, match", ARGUMENTS,
                         ids=[f"{k}={v!r}" for change, _, _ in ARGUMENTS for k, v in change.items()])
def test_paged_attention_argument_types(change, exc, match):
    args, options = _paged()
    out = sim.zeros((4, 4, 64), F16)
    with pytest.raises(exc, match=match):
        cupaged.paged_attention(**args, **{**options, **change}, out=out)
    assert not out.any(), "a rejected call wrote out"


def test_copy_blocks_takes_arrays_and_lists_of_caches():
    caches = [np.zeros((4, 16, 8), F16)]
    with pytest.raises(TypeError, match="block_mapping"):
        cupaged.copy_blocks(caches, None, [[0, 1]])
    with pytest.raises(TypeError, match="key_caches must be a list"):
        cupaged.copy_blocks(caches[0], None, np.array([[0, 1]], np.int64))
    with pytest.raises(TypeError, match="block_mapping"):
        cupaged.swap_blocks(caches[0], caches[0].copy(), [[0, 1]])


def test_v1_v2_take_validate():
    """vLLM's drop-ins check their contents too (keyword-only validate=, or CUPAGED_VALIDATE=1)."""
    inputs, _ = vllm_inputs(C(seqs=((1, 40), (1, 20)), heads=(4, 2), head_size=64))
    table = inputs["block_tables"].copy()
    table[1, 0] = -1
    out = np.zeros((2, 4, 64), F16)
    with pytest.raises(ValueError, match="block_tables\\[1\\] holds block id -1"):
        cupaged.paged_attention_v1(out, inputs["q"], inputs["key_cache"], inputs["value_cache"], 2, 0.125, table,
                                   inputs["seq_lens"], 16, 40, None, validate=True)
    with pytest.raises(TypeError, match="num_kv_heads must be an int"):
        cupaged.paged_attention_v1(out, inputs["q"], inputs["key_cache"], inputs["value_cache"], "2", 0.125, table,
                                   inputs["seq_lens"], 16, 40, None)
    assert not out.any()


@pytest.mark.parametrize("cls", ["KVCache", "BatchPlan", "BlockPool", "OutOfBlocks", "PoolUsage"])
def test_public_classes_name_module_cupaged(cls):
    assert getattr(cupaged, cls).__module__ == "cupaged"


@pytest.mark.parametrize("cls", ["RawModule", "RawKernel", "SimError", "SimMemoryError", "SimCompileError"])
def test_sim_classes_name_module_cupaged_sim(cls):
    assert getattr(sim, cls).__module__ == "cupaged.sim"


def _attention_op(op):
    """(call taking scale= and, where the op has them, softcap= / causal= / window_size=, the arrays it writes,
    filled with 7) of one attention op on small inputs."""
    args, options = _paged()
    out = sim.asarray(np.full((4, 4, 64), 7, F16))
    q, index = args["q"], [args[k] for k in ("block_tables", "seq_lens", "query_start_loc")]
    if op == "paged_attention":
        return lambda **o: cupaged.paged_attention(**args, **{**options, **o}, out=out), [out]
    if op == "run_attention":
        kv = cupaged.KvView.paged(args["key_cache"], args["value_cache"], q)
        plan = cupaged.plan_attention(q, kv, *index)
        return lambda **o: cupaged.run_attention(plan, q, kv, out, None, *index, **o), [out]
    if op == "varlen_attention":
        k, v = (sim.asarray(np.random.default_rng(i).standard_normal((60, 2, 64)).astype(F16)) for i in (0, 1))
        cu_q, cu_k = np.array([0, 1, 4], np.int32), np.array([0, 40, 60], np.int32)
        return lambda **o: cupaged.varlen_attention(q, k, v, cu_q, cu_k, out=out, **o), [out]
    rng = np.random.default_rng(0)
    if op in ("mla_decode", "mla_chunked_prefill"):
        cache, table, _ = latent_pool(rng, [5, 9], 16, F16, "auto")
        if op == "mla_decode":
            q, out = sim.zeros((2, 16, 576), F16), sim.asarray(np.full((2, 16, 512), 7, F16))
            return lambda scale: cupaged.mla_decode(q, cache, table, np.array([5, 9], np.int32), scale=scale,
                                                    out=out), [out]
        new = [sim.asarray(rng.standard_normal((2, 4, d)).astype(F16)) for d in (192, 192, 128)]
        out = sim.asarray(np.full((2, 4, 128), 7, F16))
        return lambda scale: cupaged.mla_chunked_prefill(*new, cache, table, np.array([0, 1, 2], np.int32),
                                                         np.array([5, 9]), UpProjection(rng, 4, F16), scale=scale,
                                                         out=out), [out]
    inputs, _ = vllm_inputs(C(seqs=((1, 40), (1, 20)), heads=(4, 2), head_size=64))
    bufs = [np.full((2, 4, 64), 7, F16), np.full((2, 4, 1), 7, np.float32), np.full((2, 4, 1), 7, np.float32),
            np.full((2, 4, 1, 64), 7, F16)]
    bufs = bufs if op == "paged_attention_v2" else bufs[:1]
    fn = getattr(cupaged, op)
    return lambda scale: fn(*bufs, inputs["q"], inputs["key_cache"], inputs["value_cache"], 2, scale,
                            inputs["block_tables"], inputs["seq_lens"], 16, 40, None), bufs


SCALED = ["paged_attention", "run_attention", "varlen_attention", "mla_decode", "mla_chunked_prefill",
          "paged_attention_v1", "paged_attention_v2"]
# 1e39 is inf as a float32; 3e38 is finite, but not once the kernels fold log2(e) in; 1e-50 rounds to 0
NOT_FLOAT32 = {"1e39": 1e39, "3e38": 3e38, "1e-50": 1e-50, "np 1e39": np.float64(1e39), "negative": -0.125}


def _unwritten(written):
    assert all(np.all(a == 7) for a in written), "a rejected call wrote its outputs"


@pytest.mark.parametrize("value", NOT_FLOAT32.values(), ids=list(NOT_FLOAT32))
@pytest.mark.parametrize("op", SCALED)
def test_scale_must_be_a_positive_float32_with_log2e_folded_in(op, value):
    call, written = _attention_op(op)
    with pytest.raises(ValueError, match="scale must be a .*float32"):
        call(scale=value)
    _unwritten(written)


@pytest.mark.parametrize("change, match", [({"softcap": 1e39}, "softcap must be"), ({"softcap": 3e38}, "softcap"),
                                           ({"softcap": 1e-50}, "softcap"),
                                           ({"scale": 1e20, "softcap": 1e-20}, "scale / softcap")],
                         ids=["1e39", "3e38", "1e-50", "ratio"])
@pytest.mark.parametrize("op", SCALED[:3])
def test_softcap_must_fit_float32_and_so_must_scale_over_softcap(op, change, match):
    call, written = _attention_op(op)
    with pytest.raises(ValueError, match=match):
        call(**change)
    _unwritten(written)


@pytest.mark.parametrize("change, exc, match", [
    ({"causal": 1}, TypeError, "causal must be a bool"), ({"causal": 0}, TypeError, "causal must be a bool"),
    ({"causal": "no"}, TypeError, "causal must be a bool"),
    ({"window_size": (2**40, 0)}, ValueError, "window_size must be"),
    ({"window_size": (0, 2**31)}, ValueError, "window_size must be")], ids=["1", "0", "no", "left", "right"])
@pytest.mark.parametrize("op", SCALED[:3])
def test_causal_is_a_bool_and_windows_fit_int32(op, change, exc, match):
    call, written = _attention_op(op)
    with pytest.raises(exc, match=match):
        call(**change)
    _unwritten(written)


@pytest.mark.parametrize("name", ["q", "key_cache", "value_cache", "block_tables", "seq_lens"])
def test_paged_attention_names_a_missing_array(name):
    args, options = _paged()
    with pytest.raises(TypeError, match=f"{name} must be a numpy or cupy array"):
        cupaged.paged_attention(**{**args, name: None}, **options)
    with pytest.raises(TypeError, match=f"{name} must be a numpy or cupy array"):
        cupaged.paged_attention(**{**args, name: args[name].tolist()}, **options)


def test_a_strided_workspace_is_rejected_by_name():
    args, options = _paged()
    workspace = sim.zeros(1 << 17, np.uint8)[::2]
    with pytest.raises(ValueError, match="workspace must be contiguous"):
        cupaged.paged_attention(**args, **options, workspace=workspace, kv_split_size=8)
    with pytest.raises(ValueError, match="workspace must be contiguous"):  # a plan that does not split: still checked
        cupaged.paged_attention(**args, **options, workspace=workspace)
    cache, table, _ = latent_pool(np.random.default_rng(0), [5, 9], 16, F16, "auto")
    with pytest.raises(ValueError, match="workspace must be contiguous"):
        cupaged.mla_decode(sim.zeros((2, 16, 576), F16), cache, table, np.array([5, 9], np.int32), scale=0.1,
                           kv_split_size=8, workspace=workspace)
    with pytest.raises(TypeError, match="workspace must be a numpy or cupy array"):
        cupaged.paged_attention(**args, **options, workspace=[0] * 1024, kv_split_size=8)


BAD_VIEWS = {
    "dense heads": (lambda k: cupaged.KvView.dense(k, k[:, :1]), ValueError, "v must be .*like k"),
    "dense rows": (lambda k: cupaged.KvView.dense(k, k[:9]), ValueError, "v must be .*like k"),
    "dense dtypes": (lambda k: cupaged.KvView.dense(k, k.astype(np.float32)), TypeError, "v must have k's dtype"),
    "dense list": (lambda k: cupaged.KvView.dense(k.tolist(), k), TypeError, "k must be a numpy or cupy array"),
    "dense 2-D": (lambda k: cupaged.KvView.dense(k[0], k[0]), ValueError, "k must be 3-D"),
    "mla rank 0": (lambda k: cupaged.KvView.mla(np.zeros((2, 16, 576), F16), 0), ValueError,
                   "kv_lora_rank must be >= 1"),
    "mla rank past the row": (lambda k: cupaged.KvView.mla(np.zeros((2, 16, 576), F16), 577), ValueError,
                              "kv_lora_rank must be <= 576"),
    "mla rank str": (lambda k: cupaged.KvView.mla(np.zeros((2, 16, 576), F16), "512"), TypeError,
                     "kv_lora_rank must be an int"),
    "mla list": (lambda k: cupaged.KvView.mla(np.zeros((2, 16, 576), F16).tolist(), 512), TypeError,
                 "kv_cache must be a numpy or cupy array"),
    "mla fp8 float cache": (lambda k: cupaged.KvView.mla(np.zeros((2, 16, 576), F16), 512, "fp8"), TypeError,
                            "kv_cache must have dtype uint8"),
    "paged lists": (lambda k: cupaged.KvView.paged(k.tolist(), k.tolist(), np.zeros((1, 2, 64), F16)), TypeError,
                    "key_cache must be a numpy or cupy array"),
    "paged q list": (lambda k: cupaged.KvView.paged(k[None], k[None], [[[0.0] * 64] * 2]), TypeError,
                     "q must be a numpy or cupy array"),
}


@pytest.mark.parametrize("case", BAD_VIEWS, ids=list(BAD_VIEWS))
def test_kv_views_reject_bad_arrays(case):
    make, exc, match = BAD_VIEWS[case]
    with pytest.raises(exc, match=match):
        make(np.zeros((10, 2, 64), F16))


@pytest.mark.parametrize("args, exc, match", [((-1, 4, 2, 64), ValueError, "num_tokens must be >= 0"),
                                              ((2.5, 4, 2, 64), TypeError, "num_tokens must be an int"),
                                              ((4, 4, 0, 64), ValueError, "max_splits must be >= 1"),
                                              ((4, 4, 2, "64"), TypeError, "head_size must be an int")])
def test_workspace_bytes_takes_counts(args, exc, match):
    with pytest.raises(exc, match=match):
        cupaged.workspace_bytes(*args)
    assert cupaged.workspace_bytes(4, 4, 2, 64) == 8 * 32 + 4 * 32 * 64 + 256
