"""The Python mirrors of kernel constants and parameter structs (cupaged/_mirror.py, cupaged/_attention_kernels.py)
against what the compiler makes of the source: a probe kernel reports ``sizeof`` / ``offsetof`` of every PaParams
field; the STAGES, STAGE and BYTES of the decode kernels' PdSmem and PmSmem (every cache element size, head bucket and
value layout), the MLA decode kernel's MdSmem and the prefill kernel's PfSmem (also its rows a CTA and keys a stage);
and each routed kernel's __launch_bounds__, whose threads and minimum CTAs an SM the routes' blocks and occupancy
must equal."""

from __future__ import annotations

import functools
import importlib
import re

import numpy as np
import pytest

from cupaged import _attention_kernels as kernels, attention, sim
from cupaged._mirror import constants, struct_dtype
from cupaged._plan import PlanKey

C_TYPES = {1: "unsigned char", 2: "__half", 4: "float"}
UNBOUNDED = 2**40  # shared memory an SM: only registers and threads bound the routes' occupancy


def _mirrored() -> list[tuple[str, int]]:
    """(C++ expression, Python's value) of every mirrored number but the launch bounds."""
    dtype = attention.params_dtype()
    pairs = [("sizeof(PaParams)", dtype.itemsize)]
    pairs += [(f"reinterpret_cast<const char*>(&p.{f}) - base", dtype.fields[f][1]) for f in dtype.names]
    smem = [("PdSmem", size, f"{hd}, {str(vt).lower()}", kernels.decode_pipeline(size, hd, vt),
             kernels.decode_smem_bytes(size, hd, vt)) for size in (1, 2, 4) for hd in kernels.HEAD_BUCKETS
            for vt in (False, True)]
    smem += [("PmSmem", size, f"{hd}, {str(vt).lower()}", kernels.decode_mma_pipeline(size, hd, vt),
              kernels.decode_mma_smem_bytes(size, hd, vt)) for size in (1, 2) for hd in kernels.MMA_BUCKETS
             for vt in (False, True)]
    smem += [("MdSmem", size, f"{mt}", kernels.mla_pipeline(size, mt), kernels.mla_smem_bytes(size, mt))
             for size in (1, 2) for mt in kernels.MLA_TILES]
    smem += [("PfSmem", size, f"{hd}, {vhd}", kernels.prefill_pipeline(size, hd, vhd),
              kernels.prefill_smem_bytes(size, hd, vhd)) for size in (1, 2) for hd, vhd in kernels.PREFILL_BUCKETS]
    for struct, size, args, (stages, stage), nbytes in smem:
        s = f"{struct}<{C_TYPES[size]}, {args}>"
        pairs += [(f"{s}::STAGES", stages), (f"{s}::STAGE", stage), (f"{s}::BYTES", nbytes)]
        if struct == "PfSmem":
            rows, tile = kernels.prefill_shape(*map(int, args.split(", ")))
            pairs += [(f"{s}::ROWS", rows), (f"{s}::TILE", tile)]
    return pairs


def _launch_bounds(source: str) -> dict[str, tuple[str, str]]:
    """Each kernel's __launch_bounds__ (threads, minimum CTAs an SM) as written, by kernel name."""
    found = {}
    for m in re.finditer(r"__launch_bounds__\(", source):
        depth, end = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        threads, _, min_ctas = source[m.end():end - 1].partition(",")
        found[re.match(r"\s*(\w+)", source[end:]).group(1)] = (threads.strip(), min_ctas.strip())
    return found


def _routes() -> list:
    """A route to each kernel the plan launches (mla_decode_kernel with 16 and 32 heads a CTA) on an SM whose
    shared memory never binds."""
    decode = PlanKey(q_shape=(1, 8, 128), q_dtype=np.dtype(np.float16), kind="paged", kv_cache_dtype="auto",
                     num_kv_heads=8, v_head_size=128, block_size=16, table_width=8, index_len=1, decode=True,
                     max_query_len=None, max_seq_len=None, kv_split_size=None, max_splits=None, always_partials=False,
                     sms=132, sm_shared=UNBOUNDED, decode_layout="rows", prefill_rows=True)
    gqa8 = decode._replace(q_shape=(1, 64, 128))
    cuda_cores = decode._replace(q_dtype=np.dtype(np.float32))  # 16-bit q up to head size 128: tensor cores
    prefill = decode._replace(q_shape=(64, 8, 128), decode=False)
    mla = decode._replace(q_shape=(1, 16, 576), kind="mla", num_kv_heads=1, v_head_size=512, prefill_rows=False)
    routes = [kernels.decode_route(cuda_cores), kernels.decode_route(gqa8), kernels.prefill_route(prefill),
              kernels.decode_route(mla), kernels.decode_route(mla._replace(q_shape=(1, 64, 576)))]
    names = [re.match(r"cupaged::(\w+)<", r.launch.kernel).group(1) for r in routes]
    assert names == ["paged_decode_kernel", "paged_decode_mma_kernel", "paged_prefill_kernel", "mla_decode_kernel",
                     "mla_decode_kernel"]
    return routes


def _bounded(route) -> list[tuple[str, str]]:
    """(scope, expression) of the route's kernel's threads and minimum CTAs, its template's MT in scope."""
    name, args = re.match(r"cupaged::(\w+)<(.*)>", route.launch.kernel).groups()
    threads, min_ctas = _launch_bounds(attention.FAMILY.source)[name]
    scope = f"constexpr int MT = {args.split(', ')[-1]};" if "MT" in threads + min_ctas else ""
    return [(scope, threads), (scope, min_ctas)]


@functools.cache
def _probe() -> tuple:
    """(the probe's source, its expressions): one kernel that writes every expression's value."""
    exprs = [("", e) for e, _ in _mirrored()] + [b for r in _routes() for b in _bounded(r)]
    body = "\n".join(f"  {{ {scope} out[{i}] = {e}; }}" for i, (scope, e) in enumerate(exprs))
    probe = ('extern "C" __global__ void pa_probe(long long* out) {\n  using namespace cupaged;\n  PaParams p;\n'
             '  const char* base = reinterpret_cast<const char*>(&p);\n' + body + "\n}\n")
    return attention.FAMILY.source + probe, exprs


@functools.cache
def _probed() -> list[int]:
    source, exprs = _probe()
    out = sim.zeros(len(exprs), np.int64)
    sim.RawModule(code=source, options=("-std=c++17",)).get_function("pa_probe")((1,), (1,), (out,))
    return out.tolist()


def test_params_struct_and_shared_memory_match_the_kernel():
    """PaParams' layout, and each shared-memory struct's stages, stage bytes and bytes: Python's formulas read the
    thresholds (PD_SMEM_FOR_4 ...) and stage counts (MD_STAGES_*) from the source, never a typed-in number."""
    pairs = _mirrored()
    got = _probed()[:len(pairs)]
    assert [(e, g) for (e, _), g in zip(pairs, got)] == pairs


def test_routes_occupancy_matches_the_kernels_launch_bounds():
    """Each routed kernel's block is its __launch_bounds__' threads, and the CTAs the plan counts resident on an SM
    (registers and threads alone) are the minimum its __launch_bounds__ asks for: the register budget Python reads
    (PD_REGISTERS, PM_REGISTERS, PF_REGISTERS, MD_REGISTERS of SM_REGISTERS) is the one the kernel is compiled under."""
    values = _probed()[len(_mirrored()):]
    for route, threads, min_ctas in zip(_routes(), values[::2], values[1::2]):
        assert route.launch.block == (threads, 1, 1), route.launch.kernel
        assert route.per_sm == min(min_ctas, 2048 // threads) > 0, route.launch.kernel


def test_probe_compiles_under_nvrtc():
    from cupaged._nvrtc import compile_cubin

    assert compile_cubin(_probe()[0], arch="sm_90", options=("-std=c++17",)).cubin


def test_constants_come_from_the_kernel_source():
    from cupaged import cache_gather, cache_ops

    merge_attn_states = importlib.import_module("cupaged.merge_attn_states")  # (the package exports the function)

    c = kernels.kernel_constants()
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
