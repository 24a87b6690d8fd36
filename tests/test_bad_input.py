"""Inputs every op once accepted and got wrong, or rejected with an unhelpful error. Each is now
a TypeError / ValueError naming the argument before any launch, and nothing is written:
read-only outputs and caches (numpy; they were silently left unwritten), a non-finite
softcap (every output NaN), fp8 scale arrays holding 0, -1 or NaN (checked with validate=True, as
scalars always are), a str for causal, a list for scale, a window past int32, a list for a block
mapping; public classes name their module ``cupaged``."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import sim
from tests.test_mla import latent_pool
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
