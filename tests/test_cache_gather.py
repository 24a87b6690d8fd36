"""Cache reads and block moves (gather_and_maybe_dequant_cache, cp_gather_cache, copy_blocks,
swap_blocks) against cupaged.reference, on the sim (and cuda when a GPU is present). Paged caches
come from cupaged.testing.paged_kv: shuffled block ids, garbage past each table row's live blocks,
every slot no token holds poisoned.

The default run is a covering set (tests/test_cache_ops.py's covering_set): every gather kernel
instantiation (dtype x kv-cache dtype) and word size once, every two values of any two axes
together; `-m slow` runs the full product and the 64-bit offset case (a 2 GiB cache)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import cache_gather, reference, sim
from cupaged.testing import paged_kv, poisoned
from tests.test_cache_ops import assert_bytes_equal, case_id, covering_set, full_product, record_launches

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
ENTRY = 576  # an MLA latent row: kv_lora_rank 512 + rope_dim 64


@pytest.fixture
def launched(monkeypatch):
    return record_launches(monkeypatch, cache_gather.FAMILY)


def paged_rows(device, rng, context_lens, block_size, entry=(ENTRY,), *, starts=None, **options):
    """cupaged.testing.paged_kv of sequences holding ``context_lens`` positions each, as rows of a cache
    [num_blocks, block_size, *entry] (its MLA layout, or NHD for a 2-d entry): shuffled block ids, a
    garbage table tail, every unused slot and the positions before ``starts`` (never read) poisoned."""
    layout, heads, head_size = ("mla", 1, entry[0]) if len(entry) == 1 else ("NHD", *entry)
    return paged_kv(context_lens, block_size=block_size, head_size=head_size, num_kv_heads=heads, layout=layout,
                    poison_before=starts, rng=rng, device=device, **options)


def cu_seq_lens(seq_lens):
    return np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)


GATHER_GRID = dict(dtype=DTYPES, kv_cache_dtype=["auto", "fp8", "fp8_e5m2"], seq_starts=[False, True],
                   block_size=[1, 5, 16, 32], scale_kind=["float", "array"])
GATHER_COVERING = covering_set(GATHER_GRID, full=("dtype", "kv_cache_dtype"))


def gather_case(backend, launched, *, dtype, kv_cache_dtype, seq_starts, block_size, scale_kind):
    rng = np.random.default_rng(3 + block_size)
    seq_lens = np.array([5, 0, 33, 16, 1, 47])  # an empty sequence, block_size, block_size + 1
    starts = rng.integers(0, 40, len(seq_lens)).astype(np.int32) if seq_starts else None
    kv = paged_rows(backend.name, rng, seq_lens + (0 if starts is None else starts), block_size, starts=starts,
                    dtype=dtype, kv_cache_dtype=kv_cache_dtype, spare_blocks=3, spare_columns=2)
    scale = kv.k_scale if scale_kind == "float" else np.array([kv.k_scale], np.float32)
    cu, num_tokens = cu_seq_lens(seq_lens), int(seq_lens.sum())
    token_to_seq = np.repeat(np.arange(len(seq_lens)), seq_lens).astype(np.int32)
    token_to_seq = np.concatenate([token_to_seq, np.zeros(3, np.int32)])  # 3 padding rows past the last token
    dst0 = np.full((num_tokens + 3, ENTRY), np.nan, dtype)
    dst = backend.asarray(dst0)
    cupaged.gather_and_maybe_dequant_cache(kv.key_cache, dst, kv.block_tables, backend.asarray(cu),
                                           backend.asarray(token_to_seq), num_tokens + 3, kv_cache_dtype, scale,
                                           None if starts is None else backend.asarray(starts), validate=True)
    assert launched[-1][1] == {"auto": "cupaged::KV_AUTO", "fp8": "cupaged::KV_E4M3",
                               "fp8_e5m2": "cupaged::KV_E5M2"}[kv_cache_dtype]
    cache, table = backend.to_numpy(kv.key_cache), backend.to_numpy(kv.block_tables)
    ref = reference.gather_and_maybe_dequant_cache(cache, dst0, table, cu, token_to_seq, num_tokens + 3, kv_cache_dtype,
                                                   scale, starts)
    assert_bytes_equal(backend.to_numpy(dst), ref, "dst")
    assert not np.isnan(ref[:num_tokens].astype(np.float32)).any(), "the reference read a poisoned slot"
    assert np.isnan(backend.to_numpy(dst)[num_tokens:].astype(np.float32)).all(), "padding rows were written"


@pytest.mark.parametrize("case", GATHER_COVERING, ids=list(map(case_id, GATHER_COVERING)))
def test_gather_and_maybe_dequant_cache_covering_set(backend, launched, case):
    gather_case(backend, launched, **case)


@pytest.mark.slow
@pytest.mark.parametrize("case", full_product(GATHER_GRID), ids=case_id)
def test_gather_and_maybe_dequant_cache_full_grid(backend, launched, case):
    gather_case(backend, launched, **case)


@pytest.mark.parametrize("validate", [False, True], ids=["default", "validate"])
def test_gather_skips_tokens_past_the_block_table_row(backend, validate):
    """vLLM's guard: a chunk whose seq_starts runs past the row is valid input; those tokens are skipped
    (dst rows untouched), the rest gathered, and nothing past the row is read (before: a read of the
    next row, or past the table)."""
    kv = paged_rows(backend.name, np.random.default_rng(4), [32, 10], 16)  # rows of 2 and 1 blocks: width 2
    cu = cu_seq_lens([20, 10])
    dst0 = np.full((30, ENTRY), np.nan, np.float16)
    dst = backend.asarray(dst0)
    starts = np.array([20, 0], np.int32)  # sequence 0 reads positions 20..39: 32..39 are past its row
    token_to_seq = np.repeat([0, 1], [20, 10]).astype(np.int32)
    cupaged.gather_and_maybe_dequant_cache(kv.key_cache, dst, kv.block_tables, backend.asarray(cu),
                                           backend.asarray(token_to_seq), 30, seq_starts=backend.asarray(starts),
                                           validate=validate)
    cache, table = backend.to_numpy(kv.key_cache), backend.to_numpy(kv.block_tables)
    ref = reference.gather_and_maybe_dequant_cache(cache, dst0, table, cu, token_to_seq, 30, seq_starts=starts)
    assert_bytes_equal(backend.to_numpy(dst), ref, "dst")
    assert np.isnan(backend.to_numpy(dst)[12:20].astype(np.float32)).all(), "rows past the block-table row written"
    assert not np.isnan(backend.to_numpy(dst)[:12].astype(np.float32)).any()


@pytest.mark.parametrize("bad", [-1, 2], ids=["minus1", "batch"])
def test_gather_validate_rejects_token_to_seq_outside_the_batch(backend, bad):
    kv = paged_rows(backend.name, np.random.default_rng(4), [3, 4], 16, spare_blocks=6)
    dst0 = np.full((7, ENTRY), np.nan, np.float16)
    token_to_seq = np.repeat([0, 1], [3, 4]).astype(np.int32)
    token_to_seq[5] = bad
    args = [kv.key_cache, backend.asarray(dst0), kv.block_tables, backend.asarray(cu_seq_lens([3, 4])),
            backend.asarray(token_to_seq)]
    with pytest.raises(ValueError, match="token_to_seq"):
        cupaged.gather_and_maybe_dequant_cache(*args, 7, validate=True)
    assert_bytes_equal(backend.to_numpy(args[1]), dst0, "dst after a rejected call")
    cupaged.gather_and_maybe_dequant_cache(*args, 7)  # without validate: the bad token is skipped, not read
    got = backend.to_numpy(args[1]).astype(np.float32)
    assert np.isnan(got[5]).all() and not np.isnan(got[[0, 1, 2, 3, 4, 6]]).any()


@pytest.mark.parametrize("change, exc, name", [
    (lambda a: {"dst": a["dst"].astype(np.float64)}, TypeError, "dst"),
    (lambda a: {"src_cache": a["src_cache"].astype(np.float32)}, TypeError, "src_cache"),
    (lambda a: {"dst": a["dst"][:, :100]}, ValueError, "dst"),
    (lambda a: {"block_table": a["block_table"].astype(np.int64)}, TypeError, "block_table"),
    (lambda a: {"cu_seq_lens": a["cu_seq_lens"].reshape(1, -1)}, ValueError, "cu_seq_lens"),
    (lambda a: {"token_to_seq": a["token_to_seq"].astype(np.float32)}, TypeError, "token_to_seq"),
    (lambda a: {"num_tokens": 10**6}, ValueError, "num_tokens"),
    (lambda a: {"kv_cache_dtype": "fp8"}, TypeError, "src_cache"),
    (lambda a: {"seq_starts": a["cu_seq_lens"][:1]}, ValueError, "seq_starts"),
], ids=["dst dtype", "src dtype", "dst width", "table dtype", "cu ndim", "token_to_seq dtype", "num_tokens",
        "fp8 float cache", "seq_starts short"])
def test_gather_bad_input(backend, change, exc, name):
    kv = paged_rows(backend.name, np.random.default_rng(5), [3, 4], 16, spare_blocks=6)
    dst0 = np.zeros((7, ENTRY), np.float16)
    a = dict(src_cache=kv.key_cache, dst=backend.asarray(dst0), block_table=kv.block_tables,
             cu_seq_lens=backend.asarray(cu_seq_lens([3, 4])),
             token_to_seq=backend.asarray(np.repeat([0, 1], [3, 4]).astype(np.int32)), num_tokens=7)
    with pytest.raises(exc, match=name):
        cupaged.gather_and_maybe_dequant_cache(**{**a, **change(a)})
    assert_bytes_equal(backend.to_numpy(a["dst"]), dst0, "dst")


ENTRIES = {"mla576": (ENTRY,), "heads4x64": (4, 64), "odd3": (3,)}  # 16-byte words, 16-byte words, bytes
CP_GATHER_GRID = dict(entry=list(ENTRIES), seq_starts=[False, True], block_size=[5, 16])
CP_GATHER_COVERING = covering_set(CP_GATHER_GRID, full=("entry",))


def cp_gather_case(backend, launched, *, entry, seq_starts, block_size):
    rng = np.random.default_rng(6)
    seq_lens = np.array([17, 0, 64, 3, 40])
    starts = rng.integers(0, 20, len(seq_lens)).astype(np.int32) if seq_starts else None
    kv = paged_rows(backend.name, rng, seq_lens + (0 if starts is None else starts), block_size, ENTRIES[entry],
                    starts=starts, spare_blocks=2, spare_columns=1)
    cu = cu_seq_lens(seq_lens)
    dst0 = np.full((int(cu[-1]) + 2, *ENTRIES[entry]), np.nan, np.float16)
    dst = backend.asarray(dst0)
    cupaged.cp_gather_cache(kv.key_cache, dst, kv.block_tables, backend.asarray(cu), len(seq_lens),
                            None if starts is None else backend.asarray(starts), validate=True)
    assert launched[-1] == ["1" if entry == "odd3" else "16"]
    ref = reference.cp_gather_cache(backend.to_numpy(kv.key_cache), dst0, backend.to_numpy(kv.block_tables), cu,
                                    len(seq_lens), starts)
    assert_bytes_equal(backend.to_numpy(dst), ref, "dst")
    assert not np.isnan(ref[:int(cu[-1])].astype(np.float32)).any(), "the reference read a poisoned slot"


@pytest.mark.parametrize("case", CP_GATHER_COVERING, ids=list(map(case_id, CP_GATHER_COVERING)))
def test_cp_gather_cache_covering_set(backend, launched, case):
    cp_gather_case(backend, launched, **case)


@pytest.mark.slow
@pytest.mark.parametrize("case", full_product(CP_GATHER_GRID), ids=case_id)
def test_cp_gather_cache_full_grid(backend, launched, case):
    cp_gather_case(backend, launched, **case)


@pytest.mark.slow
def test_gathers_64bit_offsets(backend, launched):
    """A latent fp8 cache past 2^31 bytes (2 GiB): sequences whose blocks sit where block_id * block
    stride passes 2^31 are gathered and dequantized (gather_and_maybe_dequant_cache), and copied as
    bytes into a dst one byte off alignment (cp_gather_cache's 1-byte path, strides in bytes), as the
    reference does (32-bit offset arithmetic would wrap to a block near the start, or fault)."""
    block_size, seq_lens = 16, [40, 37]
    block_bytes = block_size * ENTRY
    num_blocks = 2**31 // block_bytes + 8
    high = 2**31 // block_bytes + 1  # the first block whose offset passes 2^31
    assert high * block_bytes > 2**31
    kv = paged_rows("numpy", np.random.default_rng(12), seq_lens, block_size, kv_cache_dtype="fp8", spare_columns=1)
    small_table = kv.block_tables
    need = [-(-n // block_size) for n in seq_lens]
    live = np.arange(small_table.shape[1]) < np.array(need)[:, None]
    placed = np.array([1, high, num_blocks - 1, 0, high + 2, num_blocks - 3])  # small block i -> placed[i]
    assert len(placed) == kv.key_cache.shape[0]
    cache = backend.empty((num_blocks, block_size, ENTRY), np.uint8)
    cache[backend.asarray(placed)] = backend.asarray(kv.key_cache)
    table = np.where(live, placed[np.where(live, small_table, 0)], 10**8).astype(np.int32)  # garbage tail: never read
    cu, token_to_seq = cu_seq_lens(seq_lens), np.repeat([0, 1], seq_lens).astype(np.int32)
    dst0 = np.full((77, ENTRY), np.nan, np.float16)
    dst = backend.asarray(dst0)
    cupaged.gather_and_maybe_dequant_cache(cache, dst, backend.asarray(table), backend.asarray(cu),
                                           backend.asarray(token_to_seq), 77, "fp8", kv.k_scale)
    ref = reference.gather_and_maybe_dequant_cache(kv.key_cache, dst0, small_table, cu, token_to_seq, 77, "fp8",
                                                   kv.k_scale)
    assert_bytes_equal(backend.to_numpy(dst), ref, "gathered rows")
    raw = backend.asarray(np.zeros((77, ENTRY + 1), np.uint8))
    cupaged.cp_gather_cache(cache, raw[:, 1:], backend.asarray(table), backend.asarray(cu), 2)
    assert launched[-1] == ["1"]
    ref = reference.cp_gather_cache(kv.key_cache, np.zeros((77, ENTRY), np.uint8), small_table, cu, 2)
    assert_bytes_equal(backend.to_numpy(raw)[:, 1:], ref, "copied rows")


def test_cp_gather_cache_bad_input(backend):
    cache = backend.asarray(np.zeros((4, 16, 8), np.float16))
    dst = backend.asarray(np.zeros((10, 8), np.float32))
    table, cu = backend.asarray(np.zeros((1, 2), np.int32)), backend.asarray(np.array([0, 10], np.int32))
    with pytest.raises(TypeError, match="dst"):
        cupaged.cp_gather_cache(cache, dst, table, cu, 1)
    with pytest.raises(ValueError, match="block_table"):
        cupaged.cp_gather_cache(cache, backend.asarray(np.zeros((10, 8), np.float16)), table, cu, 2)


@pytest.mark.parametrize("layout", ["NHD", "HND", "vllm", "mla", "fp8_vllm", "odd_block"])
def test_copy_blocks(backend, layout):
    rng = np.random.default_rng(7)
    nb = 40
    shapes = {"NHD": [(nb, 16, 4, 64)] * 2, "HND": [(nb, 4, 16, 64)] * 2,
              "vllm": [(nb, 4, 8, 16, 8), (nb, 4, 64, 16)], "mla": [(nb, 16, 576)],
              "fp8_vllm": [(nb, 4, 4, 16, 16), (nb, 4, 64, 16)], "odd_block": [(nb, 3, 1, 5)] * 2}[layout]
    dtype = np.uint8 if layout == "fp8_vllm" else np.float16
    caches = [[rng.standard_normal(s).astype(dtype) if dtype != np.uint8 else rng.integers(0, 255, s).astype(np.uint8)
               for s in shapes] for _ in range(3)]
    keys = [c[0] for c in caches]
    values = None if layout == "mla" else [c[1] for c in caches]
    perm = rng.permutation(nb)
    mapping = np.stack([perm[:12], perm[12:24]], axis=1).astype(np.int64)  # distinct sources and destinations
    dev_keys = [backend.asarray(k) for k in keys]
    dev_values = None if values is None else [backend.asarray(v) for v in values]
    cupaged.copy_blocks(dev_keys, dev_values, mapping)
    ref_keys, ref_values = reference.copy_blocks(keys, values, mapping)
    for i, (got, ref) in enumerate(zip(dev_keys, ref_keys)):
        assert_bytes_equal(backend.to_numpy(got), ref, f"key_caches[{i}]")
    for i, (got, ref) in enumerate(zip(dev_values or [], ref_values or [])):
        assert_bytes_equal(backend.to_numpy(got), ref, f"value_caches[{i}]")


def test_copy_blocks_device_mapping_and_bad_input(backend):
    rng = np.random.default_rng(8)
    key0 = rng.standard_normal((10, 16, 2, 64)).astype(np.float32)
    key = backend.asarray(key0)
    mapping = backend.asarray(np.array([[1, 2], [3, 4]], np.int64))
    cupaged.copy_blocks([key], None, mapping)
    ref, _ = reference.copy_blocks([key0], None, np.array([[1, 2], [3, 4]]))
    assert_bytes_equal(backend.to_numpy(key), ref[0], "key cache")
    before = backend.to_numpy(key).copy()
    for bad, exc, name in ((np.array([[1, 10]], np.int64), ValueError, r"block_mapping\[0\] has destination block 10"),
                           (np.array([[1, 2]], np.int32), TypeError, "block_mapping"),
                           (np.array([1, 2], np.int64), ValueError, "block_mapping")):
        with pytest.raises(exc, match=name):
            cupaged.copy_blocks([key], None, bad)
    with pytest.raises(ValueError, match="value_caches"):
        cupaged.copy_blocks([key], [key, key], np.array([[1, 2]], np.int64))
    with pytest.raises(ValueError, match="outside key_caches"):
        cupaged.copy_blocks([key], None, backend.asarray(np.array([[-1, 2]], np.int64)), validate=True)
    assert_bytes_equal(backend.to_numpy(key), before, "key cache after rejected calls")


def test_copy_blocks_mapping_checked_per_cache(backend):
    """A host mapping is checked against each cache's own block count, the first bad entry named
    (the ids fit the larger cache; only the smaller one rejects row 1's source), and nothing is
    copied; with no caches at all there is nothing to check or copy."""
    big, small = (backend.asarray(np.arange(n * 8, dtype=np.float32).reshape(n, 8)) for n in (12, 6))
    with pytest.raises(ValueError, match=r"block_mapping\[1\] has source block 7, outside key_caches\[1\]'s 6 blocks"):
        cupaged.copy_blocks([big, small], None, np.array([[1, 2], [7, 3], [2, 8]], np.int64))
    with pytest.raises(ValueError, match=r"block_mapping\[2\] has destination block 6, outside value_caches\[0\]"):
        cupaged.copy_blocks([big], [small], np.array([[1, 2], [0, 3], [2, 6]], np.int64))
    assert (backend.to_numpy(big)[:, 0] == np.arange(12) * 8).all()
    assert (backend.to_numpy(small)[:, 0] == np.arange(6) * 8).all()
    cupaged.copy_blocks([], None, np.array([[0, 1]], np.int64))


def test_swap_blocks_host_host():
    rng = np.random.default_rng(9)
    src = rng.standard_normal((6, 16, 2, 64)).astype(np.float16)
    dst0 = poisoned((9, 16, 2, 64), np.float16)
    dst = dst0.copy()
    mapping = np.array([[0, 8], [5, 1], [2, 2]], np.int64)
    cupaged.swap_blocks(src, dst, mapping)
    assert_bytes_equal(dst, reference.swap_blocks(src, dst0, mapping), "dst")
    with pytest.raises(ValueError, match="destination block 9"):
        cupaged.swap_blocks(src, dst, np.array([[0, 9]], np.int64))
    with pytest.raises(ValueError, match="source block 6"):
        cupaged.swap_blocks(src, dst, np.array([[6, 0]], np.int64))
    with pytest.raises(TypeError, match="dtype"):
        cupaged.swap_blocks(src.astype(np.float32), dst, mapping)
    with pytest.raises(ValueError, match="blocks differ"):
        cupaged.swap_blocks(src[:, :8], dst, mapping)


def _swap_host(kind, values):
    """``values`` as a host cache: pageable, pinned (copied in place, asynchronously) or with
    non-contiguous blocks (through staging)."""
    import cupyx

    if kind == "pageable":
        return values.copy()
    if kind == "pinned":
        out = cupyx.empty_pinned(values.shape, values.dtype)
    else:
        out = np.zeros((*values.shape[:-1], 2 * values.shape[-1]), values.dtype)[..., :values.shape[-1]]
    out[...] = values
    return out


def _swap_device(kind, values):
    """``values`` as a device cache: contiguous, blocks two apart (``kv[:, 0]``: copied block by
    block) or with non-contiguous blocks (gathered / scattered by a kernel)."""
    import cupy

    if kind == "contiguous":
        return cupy.asarray(values)
    if kind == "dim0_strided":
        out = cupy.zeros((values.shape[0], 2, *values.shape[1:]), values.dtype)[:, 0]
    else:
        out = cupy.zeros((*values.shape[:-1], 2 * values.shape[-1]), values.dtype)[..., :values.shape[-1]]
    out[...] = cupy.asarray(values)
    return out


@pytest.mark.skipif("not __import__('tests.conftest').conftest.gpu_available()", reason="no GPU")
@pytest.mark.parametrize("device_kind", ["contiguous", "dim0_strided", "blocks_strided"])
@pytest.mark.parametrize("host_kind", ["pageable", "pinned", "blocks_strided"])
def test_swap_blocks_host_device_round_trip(host_kind, device_kind):
    """Host -> device -> device -> host against the reference, with runs of adjacent blocks and
    single pairs; the host result is read without a synchronize (device -> host synchronizes)."""
    import cupy

    rng = np.random.default_rng(10)
    block = (16, 2, 64)
    host0 = rng.standard_normal((6, *block)).astype(np.float16)
    device0, other0, back0 = (poisoned((n, *block), np.float16) for n in (9, 9, 6))
    to_device = np.array([[0, 6], [1, 7], [2, 8], [5, 1], [3, 2]], np.int64)
    host, device = _swap_host(host_kind, host0), _swap_device(device_kind, device0)
    cupaged.swap_blocks(host, device, to_device)  # a pinned host is read later: it stays alive until device.get()
    device_ref = reference.swap_blocks(host0, device0, to_device)
    assert_bytes_equal(device.get(), device_ref, "host -> device")
    within = np.array([[6, 0], [7, 1], [8, 2], [1, 5]], np.int64)
    other = cupy.asarray(other0)
    cupaged.swap_blocks(device, other, within)
    other_ref = reference.swap_blocks(device_ref, other0, within)
    assert_bytes_equal(other.get(), other_ref, "device -> device")
    back, to_host = _swap_host(host_kind, back0), np.array([[0, 3], [1, 4], [2, 5], [5, 0]], np.int64)
    cupaged.swap_blocks(other, back, to_host)
    assert_bytes_equal(back, reference.swap_blocks(other_ref, back0, to_host), "device -> host")
    chain = np.array([[6, 7], [7, 8]], np.int64)
    cupaged.swap_blocks(device, device, chain)  # one cache: every block read before any is written
    assert_bytes_equal(device.get(), reference.swap_blocks(device_ref, device_ref, chain), "within one cache")


STRIDED_MAPPINGS = {  # every one names the pairs (0, 3) and (1, 4)
    "rows two apart": lambda: np.repeat(np.array([[0, 3], [1, 4]], np.int64), 2, 0)[::2],
    "columns of a wider array": lambda: np.array([[0, 3, 9], [1, 4, 9]], np.int64)[:, :2],
    "columns swapped back": lambda: np.array([[3, 0], [4, 1]], np.int64)[:, ::-1],
    "column-major": lambda: np.asfortranarray(np.array([[0, 3], [1, 4]], np.int64)),
}


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("kind", STRIDED_MAPPINGS)
def test_copy_blocks_takes_a_mapping_of_any_strides(backend, kind, where):
    """The kernel reads the pairs as packed rows: a strided mapping is made contiguous first (before:
    rows two apart copied block 3 twice and block 4 never; a slice of a wider array read its third column)."""
    mapping = STRIDED_MAPPINGS[kind]()
    if where == "device":  # a strided view of a device array
        wide = backend.asarray(np.zeros((4, 3), np.int64))
        wide[::2, :2] = backend.asarray(np.ascontiguousarray(mapping))
        mapping = wide[::2, :2]
    cache0 = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    cache = backend.asarray(cache0)
    cupaged.copy_blocks([cache], None, mapping)
    ref, _ = reference.copy_blocks([cache0], None, np.array([[0, 3], [1, 4]]))
    assert_bytes_equal(backend.to_numpy(cache), ref[0], "cache")


RACING_MAPPINGS = {  # pairs of one launch run in parallel on a GPU
    "source written earlier": ([[1, 2], [2, 3]], "block 2 is both a source and a destination"),
    "source written later": ([[2, 3], [1, 2]], "block 2 is both a source and a destination"),
    "onto itself": ([[4, 4]], "block 4 is both a source and a destination"),
    "destination twice": ([[1, 3], [2, 3]], "destination block 3 appears twice"),
}


@pytest.mark.parametrize("how", ["validate", "env"])
@pytest.mark.parametrize("kind", RACING_MAPPINGS)
def test_copy_blocks_validate_rejects_mappings_that_race(backend, monkeypatch, kind, how):
    pairs, message = RACING_MAPPINGS[kind]
    cache0 = np.arange(6 * 8, dtype=np.float16).reshape(6, 8)
    keys, values = [backend.asarray(cache0)], [backend.asarray(cache0 + 1)]
    options = {"validate": True}
    if how == "env":
        monkeypatch.setenv("CUPAGED_VALIDATE", "1")
        options = {}
    for mapping in (np.array(pairs, np.int64), backend.asarray(np.array(pairs, np.int64))):
        with pytest.raises(ValueError, match=rf"^block_mapping: {message}"):
            cupaged.copy_blocks(keys, values, mapping, **options)
    assert_bytes_equal(backend.to_numpy(keys[0]), cache0, "key cache after rejected calls")
    assert_bytes_equal(backend.to_numpy(values[0]), cache0 + 1, "value cache after rejected calls")


def test_copy_blocks_validate_passes_the_pools_pending_copies(backend):
    """BlockPool's copy-on-write copies never race: validate=True runs them."""
    pool = cupaged.BlockPool(12, 4)
    for seq in "abc":
        pool.append(seq, 6)
    for parent, child in (("a", "a1"), ("a", "a2"), ("b", "b1"), ("a1", "a3")):
        pool.fork(parent, child)
    for seq in ("a", "a1", "a2", "b", "a3"):
        pool.append(seq, 1)
    mapping = pool.take_pending_copies()
    assert len(mapping) == 4
    cache0 = np.arange(12 * 4, dtype=np.float32).reshape(12, 4)
    cache = backend.asarray(cache0)
    cupaged.copy_blocks([cache], None, mapping, validate=True)
    ref, _ = reference.copy_blocks([cache0], None, mapping)
    assert_bytes_equal(backend.to_numpy(cache), ref[0], "cache")


def test_swap_blocks_takes_a_mapping_of_any_strides():
    src = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    for kind, make in STRIDED_MAPPINGS.items():
        dst0 = poisoned((6, 8), np.float32)
        dst = dst0.copy()
        cupaged.swap_blocks(src, dst, make())
        assert_bytes_equal(dst, reference.swap_blocks(src, dst0, np.array([[0, 3], [1, 4]])), kind)


def test_gather_validate_rejects_a_sequence_longer_than_its_block_table_row(backend):
    """Without seq_starts a sequence's own tokens past its row are no chunk running off the end (vLLM's guard,
    test_gather_skips_tokens_past_the_block_table_row): cu_seq_lens contradicts block_table (before: the
    tokens past the row were skipped, dst rows left unwritten, even under validate=True)."""
    cache = backend.asarray(np.random.default_rng(4).standard_normal((8, 4, ENTRY)).astype(np.float16))
    table = backend.asarray(np.array([[0, 1, 2], [3, 4, 5]], np.int32))  # rows of 3 blocks of 4 positions
    cu = cu_seq_lens([13, 10])  # sequence 0 claims 13 tokens: its row holds 12
    dst0 = np.full((23, ENTRY), np.nan, np.float16)
    dst = backend.asarray(dst0)
    token_to_seq = np.repeat([0, 1], [13, 10]).astype(np.int32)
    with pytest.raises(ValueError, match=r"sequence 0 reads position 12, past its block_table row of 3 blocks x 4 "
                                         r"\(cu_seq_lens too large\)"):
        cupaged.gather_and_maybe_dequant_cache(cache, dst, table, backend.asarray(cu), backend.asarray(token_to_seq),
                                               23, validate=True)
    assert_bytes_equal(backend.to_numpy(dst), dst0, "dst after a rejected call")


def test_gathers_reject_dst_sharing_memory_with_src_cache(backend):
    """dst a view of src_cache: the gather would overwrite rows it has still to read."""
    kv = paged_rows(backend.name, np.random.default_rng(4), [3, 4], 16, spare_blocks=6)
    cache = kv.key_cache
    before = backend.to_numpy(cache).copy()
    dst = cache.reshape(-1, ENTRY)[16:23]
    cu, table = backend.asarray(cu_seq_lens([3, 4])), kv.block_tables
    with pytest.raises(ValueError, match="dst and src_cache share memory"):
        cupaged.gather_and_maybe_dequant_cache(cache, dst, table, cu,
                                               backend.asarray(np.repeat([0, 1], [3, 4]).astype(np.int32)), 7)
    with pytest.raises(ValueError, match="dst and src_cache share memory"):
        cupaged.cp_gather_cache(cache, dst, table, cu, 2)
    assert_bytes_equal(backend.to_numpy(cache), before, "src_cache after rejected calls")


@pytest.mark.parametrize("op", ["gather_and_maybe_dequant_cache", "cp_gather_cache", "copy_blocks"])
def test_missing_arrays_are_type_errors_naming_them(op):
    cache, dst = sim.zeros((4, 16, 8), np.float16), sim.zeros((7, 8), np.float16)
    table, cu = np.zeros((2, 1), np.int32), cu_seq_lens([3, 4])
    calls = {"gather_and_maybe_dequant_cache": (lambda: cupaged.gather_and_maybe_dequant_cache(
                 cache, dst, table, cu, None, 7), "token_to_seq"),
             "cp_gather_cache": (lambda: cupaged.cp_gather_cache(cache, dst, None, cu, 2), "block_table"),
             "copy_blocks": (lambda: cupaged.copy_blocks([cache], None, None), "block_mapping")}
    call, name = calls[op]
    with pytest.raises(TypeError, match=rf"^{name} must be a numpy or cupy array, got None"):
        call()
