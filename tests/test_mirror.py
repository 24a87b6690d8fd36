"""The Python mirrors of kernel constants and parameter structs (cupaged/_mirror.py) against what the
compiler lays out: a kernel reports ``sizeof`` / ``offsetof`` of every field, the decode
kernels' PdSmem and PmSmem (every cache element size and head bucket), the MLA decode kernel's MdSmem and the
prefill kernel's PfSmem (its bytes, rows a CTA and keys a stage)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from cupaged import _attention_kernels as kernels, attention, sim
from cupaged._mirror import constants, struct_dtype


def _probe_source() -> tuple:
    fields = list(attention.params_dtype().names)
    lines = [f"  out[{1 + i}] = reinterpret_cast<const char*>(&p.{f}) - base;" for i, f in enumerate(fields)]
    decode = [("PdSmem", c, size, hd, vt) for c, size in (("unsigned char", 1), ("__half", 2), ("float", 4))
              for hd in attention.HEAD_BUCKETS for vt in (", false", ", true")]
    decode += [("PmSmem", c, size, hd, vt) for c, size in (("unsigned char", 1), ("__half", 2))
               for hd in kernels.MMA_BUCKETS for vt in (", false", ", true")]
    lines += [f"  out[{1 + len(fields) + i}] = cupaged::{s}<{c}, {hd}{vt}>::BYTES;"
              for i, (s, c, _, hd, vt) in enumerate(decode)]
    mla = [(c, size, mt) for c, size in (("unsigned char", 1), ("__half", 2)) for mt in kernels.MLA_TILES]
    at = 1 + len(fields) + len(decode)
    lines += [f"  out[{at + i}] = cupaged::MdSmem<{c}, {mt}>::BYTES;" for i, (c, _, mt) in enumerate(mla)]
    prefill = [(c, size, hd, vhd) for c, size in (("unsigned char", 1), ("__half", 2))
               for hd, vhd in kernels.PREFILL_BUCKETS]
    at += len(mla)
    lines += [f"  out[{at + 3 * i + j}] = cupaged::PfSmem<{c}, {hd}, {vhd}>::{f};"
              for i, (c, _, hd, vhd) in enumerate(prefill) for j, f in enumerate(("BYTES", "ROWS", "TILE"))]
    probe = ('extern "C" __global__ void pa_layout(long long* out) {\n  cupaged::PaParams p;\n'
             '  const char* base = reinterpret_cast<const char*>(&p);\n  out[0] = sizeof(cupaged::PaParams);\n'
             + "\n".join(lines) + "\n}\n")
    return attention.FAMILY.source + probe, fields, decode, mla, prefill


def test_params_struct_and_shared_memory_match_the_kernel():
    source, fields, decode, mla, prefill = _probe_source()
    out = sim.zeros(1 + len(fields) + len(decode) + len(mla) + 3 * len(prefill), np.int64)
    sim.RawModule(code=source, options=("-std=c++17",)).get_function("pa_layout")((1,), (1,), (out,))
    dtype = attention.params_dtype()
    assert out[0] == dtype.itemsize
    assert out[1:1 + len(fields)].tolist() == [dtype.fields[f][1] for f in fields]
    n = 1 + len(fields)
    want = [kernels.decode_smem_bytes(size, hd, "true" in vt) if s == "PdSmem"
            else kernels.decode_mma_smem_bytes(size, hd, "true" in vt) for s, _, size, hd, vt in decode]
    assert out[n:n + len(decode)].tolist() == want
    n += len(decode)
    assert out[n:n + len(mla)].tolist() == [kernels.mla_smem_bytes(size, mt) for _, size, mt in mla]
    assert out[n + len(mla):].tolist() == [x for _, size, hd, vhd in prefill
                                           for x in (kernels.prefill_smem_bytes(size, hd, vhd),
                                                     *kernels.prefill_shape(hd, vhd))]


def test_probe_compiles_under_nvrtc():
    from cupaged._nvrtc import compile_cubin

    assert compile_cubin(_probe_source()[0], arch="sm_90", options=("-std=c++17",)).cubin


def test_constants_come_from_the_kernel_source():
    from cupaged import cache_gather, cache_ops

    merge_attn_states = importlib.import_module("cupaged.merge_attn_states")  # (the package exports the function)

    c = attention.kernel_constants()
    for name, value in c.items():
        assert f"constexpr int {name} = {value};" in attention.FAMILY.source
    for module, name in ((cache_ops, "CACHE_OPS_THREADS"), (cache_gather, "CACHE_GATHER_THREADS")):
        assert f"constexpr int {name} = {module._threads()};" in module.FAMILY.source
        assert f"__launch_bounds__({name}" in module.FAMILY.source
    assert "__launch_bounds__(MERGE_THREADS)" in merge_attn_states.FAMILY.source
    assert constants(merge_attn_states.FAMILY.source, "MERGE_THREADS") == {"MERGE_THREADS": 256}


def test_struct_parser_on_a_hand_made_struct():
    src = "struct S {\n  long long a, b;  // two\n  float x;\n  int n, m;\n  unsigned u;\n  double d;\n};"
    dtype = struct_dtype(src, "S")
    assert dtype.names == ("a", "b", "x", "n", "m", "u", "d")
    assert [dtype.fields[n][1] for n in dtype.names] == [0, 8, 16, 20, 24, 28, 32] and dtype.itemsize == 40
    with pytest.raises(ValueError, match="cannot mirror"):
        struct_dtype("struct T { float* p; };", "T")
    with pytest.raises(KeyError, match="NOPE"):
        constants("constexpr int A = 1;", "NOPE")
