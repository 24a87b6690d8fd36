"""Pin the Hopper ISA oracles in tests/sim/hopper_isa.py to facts stated in the PTX ISA and driver API.

Each model is checked against statements read off the documentation (named per test), and each is shown to
tell a deliberately broken layout (swapped LBO/SBO, no swizzle XOR, transposed fragment, ...) from the right
one on random data, so that an emulation with such a bug cannot pass a test that uses the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.sim import hopper_isa as isa

RNG = np.random.default_rng(20240611)


def _rand(shape, dtype=np.float16):
    return RNG.standard_normal(shape).astype(dtype)


def _chunk(addr):
    return (np.asarray(addr) % 128) // 16


# ---------------------------------------------------------------------------------------------------------
# 9.7.15.5.1.2.2 Matrix Descriptor Format


def test_descriptor_fields_and_swizzle_codes():
    d = isa.descriptor(start=0x1230, lbo=0x40, sbo=0x400, swizzle="64B", base_offset=3)
    assert d == 0x123 | (0x4 << 16) | (0x40 << 32) | (3 << 49) | (2 << 62)
    codes = {s: isa.descriptor(0, 16, 16, s) >> 62 for s in isa.SWIZZLES}
    assert codes == {"none": 0, "128B": 1, "64B": 2, "32B": 3}  # ISA: 0 none, 1 128B, 2 64B, 3 32B
    # matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4: 14 bits, address bits above 17 dropped.
    assert isa.descriptor(0x40010, 0, 0, "none") == 1
    assert isa.descriptor(0x3FFF0, 0x3FFF0, 0x3FFF0, "none") == 0x3FFF | 0x3FFF << 16 | 0x3FFF << 32
    for bad in ({"start": 8}, {"lbo": 24}, {"sbo": 4}):
        with pytest.raises(ValueError):
            isa.descriptor(**{"start": 0, "lbo": 16, "sbo": 16, "swizzle": "none", **bad})
    assert isa.descriptor(0, 32, 64, "none") != isa.descriptor(0, 64, 32, "none")  # swapped LBO/SBO shows


# ---------------------------------------------------------------------------------------------------------
# 9.7.15.5.1.1 Register fragments


def test_accumulator_facts_from_the_figure():
    c = isa.accumulator_coords(64)
    assert c.shape == (128, 32, 2)
    assert c[0, :8].tolist() == [[0, 0], [0, 1], [8, 0], [8, 1], [0, 8], [0, 9], [8, 8], [8, 9]]
    assert c[1, :4].tolist() == [[0, 2], [0, 3], [8, 2], [8, 3]]  # threadID_in_group picks the column pair
    assert c[4, :4].tolist() == [[1, 0], [1, 1], [9, 0], [9, 1]]  # groupID picks the row
    assert c[32, :2].tolist() == [[16, 0], [16, 1]]  # warp 1 owns rows 16..31
    assert c[127, 0].tolist() == [55, 6] and c[127, -1].tolist() == [63, 63]
    for n in (8, 24, 256):
        cn = isa.accumulator_coords(n)
        flat = cn[..., 0] * n + cn[..., 1]
        assert np.array_equal(np.sort(flat.ravel()), np.arange(64 * n))  # every D element exactly once


def test_accumulator_matches_mma_m16n8_cd_table_per_warp():
    """Each warp's registers 4q..4q+3 are the mma.m16n8 C/D fragment of columns 8q..8q+7, rows 16 warp.."""
    c = isa.accumulator_coords(32)
    lane = np.arange(32)
    g, t = lane >> 2, lane % 4
    for warp in range(4):
        for q in range(4):
            blk = c[32 * warp:32 * warp + 32, 4 * q:4 * q + 4]
            for i in range(4):  # ISA mma.m16n8k16 C/D table: row = g (c0, c1) or g + 8; col = 2t + (i & 1)
                assert np.array_equal(blk[:, i, 0], 16 * warp + g + 8 * (i >= 2))
                assert np.array_equal(blk[:, i, 1], 8 * q + 2 * t + (i & 1))


def test_accumulator_f16_packs_consecutive_elements_low_half_first():
    f32, f16 = isa.accumulator_coords(48), isa.accumulator_coords_f16(48)
    assert f16.shape == (128, 12, 2, 2)
    assert f16[0, 0].tolist() == [[0, 0], [0, 1]] and f16[0, 1].tolist() == [[8, 0], [8, 1]]
    assert np.array_equal(f16[:, :, 0], f32[:, 0::2]) and np.array_equal(f16[:, :, 1], f32[:, 1::2])


def test_accumulator_catches_a_transposed_fragment():
    d = _rand((64, 64), np.float32)
    c = isa.accumulator_coords(64)
    regs = d[c[..., 0], c[..., 1]]
    assert not np.array_equal(regs, d[c[..., 1], c[..., 0]])  # rows/cols swapped
    back = np.zeros_like(d)
    back[c[..., 0], c[..., 1]] = regs
    assert np.array_equal(back, d)


def test_a_registers_16bit():
    a = isa.a_register_coords(2)
    assert a.shape == (128, 4, 2, 2)
    assert a[0].tolist() == [[[0, 0], [0, 1]], [[8, 0], [8, 1]], [[0, 8], [0, 9]], [[8, 8], [8, 9]]]
    assert a[5, 0].tolist() == [[1, 2], [1, 3]] and a[32, 0, 0].tolist() == [16, 0]
    lane = np.arange(32)
    g, t = lane >> 2, lane % 4
    for warp in range(4):  # ISA mma.m16n8k16 A table: row g for a0,a1,a4,a5; col 2t + (i&1) (+8 for i>=4)
        blk = a[32 * warp:32 * warp + 32].reshape(32, 8, 2)
        for i in range(8):
            assert np.array_equal(blk[:, i, 0], 16 * warp + g + 8 * (i in (2, 3, 6, 7)))
            assert np.array_equal(blk[:, i, 1], 2 * t + (i & 1) + 8 * (i >= 4))
    flat = a[..., 0] * 16 + a[..., 1]
    assert np.array_equal(np.sort(flat.ravel()), np.arange(64 * 16))


def test_a_registers_8bit():
    a = isa.a_register_coords(1)
    assert a.shape == (128, 4, 4, 2)
    assert a[0, :, 0].tolist() == [[0, 0], [8, 0], [0, 16], [8, 16]]
    assert a[0, 0, :, 1].tolist() == [0, 1, 2, 3] and a[1, 0, :, 1].tolist() == [4, 5, 6, 7]
    lane = np.arange(32)
    g, t = lane >> 2, lane % 4
    blk = a[64:96].reshape(32, 16, 2)  # warp 2 vs ISA mma.m16n8k32 A: row g for i<4 or 8<=i<12, else g+8
    for i in range(16):
        assert np.array_equal(blk[:, i, 0], 32 + g + 8 * (i in range(4, 8) or i >= 12))
        assert np.array_equal(blk[:, i, 1], 4 * t + (i & 3) + 16 * (i >= 8))
    flat = a[..., 0] * 32 + a[..., 1]
    assert np.array_equal(np.sort(flat.ravel()), np.arange(64 * 32))
    a_mat = RNG.integers(0, 256, (64, 32), dtype=np.uint8)  # registers 0/1 (rows g / g+8) swapped: caught
    assert not np.array_equal(a_mat[a[..., 0], a[..., 1]], a_mat[a[..., 0] ^ 8, a[..., 1]])


# ---------------------------------------------------------------------------------------------------------
# 9.7.15.5.1.2 Shared memory matrix layout


def test_k_major_interleave_core_matrices():
    addr = isa.operand_addresses(64, 2, "K", "none", lbo=128, sbo=256, start=4096)
    r, k = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    assert np.array_equal(addr[:8, :8], 4096 + 16 * r + 2 * k)  # core matrix: 8 rows x 16 contiguous bytes
    assert np.array_equal(addr[:, 8:], addr[:, :8] + 128)  # LBO: next core matrix along K
    assert np.array_equal(addr[8:16], addr[:8] + 256)  # SBO: next 8 rows
    assert len(np.unique(addr)) == addr.size
    a8 = isa.operand_addresses(8, 1, "K", "none", lbo=128, sbo=256)
    assert a8[1, :16].tolist() == list(range(16, 32)) and a8[0, 16] == 128


@pytest.mark.parametrize("swizzle,xor", [("128B", lambda r: r % 8), ("64B", lambda r: (r >> 1) % 4),
                                         ("32B", lambda r: (r >> 2) % 2)])
def test_k_major_swizzled_chunks(swizzle, xor):
    span = isa.SWIZZLE_SPAN[swizzle]
    r = np.arange(64)[:, None]
    for j in range(span // 32):  # K slices inside the atom are reached by moving the start address
        addr = isa.operand_addresses(64, 2, "K", swizzle, lbo=16, sbo=8 * span, start=32 * j)
        logical = 2 * j + np.arange(16)[None, :] // 8  # 16-byte chunk of the row before swizzling
        assert np.array_equal(addr // span, np.broadcast_to(r, addr.shape))  # rows stay whole
        assert np.array_equal(addr % span // 16, logical ^ xor(r))
        assert np.array_equal(addr % 16, np.broadcast_to(2 * (np.arange(16) % 8), addr.shape))
    a0 = isa.operand_addresses(64, 2, "K", swizzle, 16, 8 * span)
    period = 8 * span  # ISA: the pattern repeats every 1024 / 512 / 256 bytes
    assert np.array_equal(isa.operand_addresses(64, 2, "K", swizzle, 16, 8 * span, start=period), a0 + period)


def test_mn_major_interleave_and_128b():
    addr = isa.operand_addresses(16, 2, "MN", "none", lbo=512, sbo=128)
    assert addr[:8, 0].tolist() == list(range(0, 16, 2)) and addr[0, :8].tolist() == list(range(0, 128, 16))
    assert np.array_equal(addr[8:], addr[:8] + 128) and np.array_equal(addr[:, 8:], addr[:, :8] + 512)
    sw = isa.operand_addresses(128, 2, "MN", "128B", lbo=2048, sbo=1024)
    mn, k = np.meshgrid(np.arange(64), np.arange(8), indexing="ij")
    assert np.array_equal(sw[:64, :8] // 128, k) and np.array_equal(sw[:64, :8] % 16, 2 * (mn % 8))
    assert np.array_equal(sw[:64, :8] % 128 // 16, (mn // 8) ^ k)
    assert np.array_equal(sw[64:], sw[:64] + 2048) and np.array_equal(sw[:, 8:], sw[:, :8] + 1024)
    with pytest.raises(ValueError):
        isa.operand_addresses(64, 1, "MN", "128B", 16, 1024)


@pytest.mark.parametrize("major,swizzle,lbo,sbo", [("K", "none", 128, 1024), ("K", "128B", 16, 1024),
                                                   ("MN", "none", 2048, 128), ("MN", "64B", 1024, 512)])
def test_operand_round_trip_and_broken_variants(major, swizzle, lbo, sbo):
    m = _rand((64, 16))
    addr = isa.operand_addresses(64, 2, major, swizzle, lbo, sbo)
    smem = isa.store_operand(m, addr, np.zeros(16384, np.uint8))
    assert np.array_equal(isa.load_operand(smem, addr, np.float16), m)
    broken = [isa.operand_addresses(64, 2, "MN" if major == "K" else "K", swizzle, lbo, sbo)]  # transposed
    if swizzle != "none":  # the swizzle XOR left out (applying it twice undoes it)
        broken.append(isa.swizzle_address(addr, swizzle))
    if major == "MN" or swizzle == "none":  # swizzled K-major does not use LBO
        broken.append(isa.operand_addresses(64, 2, major, swizzle, sbo, lbo))  # LBO and SBO swapped
    for wrong in broken:
        assert not np.array_equal(isa.load_operand(smem, wrong, np.float16), m)


# ---------------------------------------------------------------------------------------------------------
# 5.5 Tensors / cuTensorMapEncodeTiled (tile mode)


def test_tensor_tile_dense_box_oob_zero_and_strides():
    g = _rand((40, 96))
    tile = isa.tensor_tile(g, (8, 32), (3, 16)).view(np.float16).reshape(8, 32)
    assert np.array_equal(tile, g[3:11, 16:48])
    edge = isa.tensor_tile(g, (8, 32), (-2, 80)).view(np.float16).reshape(8, 32)
    assert np.all(edge[:2] == 0) and np.all(edge[:, 16:] == 0)  # out of bounds: zero fill
    assert np.array_equal(edge[2:, :16], g[0:6, 80:96])
    # elementStrides: ceil(box / stride) elements per dimension; the innermost stride is ignored
    st = isa.tensor_tile(g, (7, 16), (1, 0), element_strides=(2, 4)).view(np.float16).reshape(4, 16)
    assert np.array_equal(st, g[1:9:2, 0:16])
    g3 = _rand((4, 6, 16))
    t3 = isa.tensor_tile(g3[:, ::2, :], (2, 3, 8), (1, 0, 8)).view(np.float16).reshape(2, 3, 8)
    assert np.array_equal(t3, g3[1:3, 0:6:2, 8:16])  # a strided global view


@pytest.mark.parametrize("swizzle,xor", [("128B", lambda r: r % 8), ("64B", lambda r: (r >> 1) % 4),
                                         ("32B", lambda r: (r >> 2) % 2)])
def test_tensor_tile_swizzle(swizzle, xor):
    span = isa.SWIZZLE_SPAN[swizzle]
    g = _rand((32, 128))
    raw = isa.tensor_tile(g, (16, span // 2), (5, 8), swizzle=swizzle).reshape(16, span // 16, 16)
    dense = np.ascontiguousarray(g[5:21, 8:8 + span // 2]).view(np.uint8).reshape(16, span // 16, 16)
    for r in range(16):
        for c in range(span // 16):  # 16-byte chunk c of row r lands at chunk c ^ f(r) of the same row
            assert np.array_equal(raw[r, c ^ xor(r)], dense[r, c])
    plain = isa.tensor_tile(g, (16, span // 2), (5, 8))
    assert not np.array_equal(raw.ravel(), plain)  # a TMA that forgot the swizzle is caught
    with pytest.raises(ValueError):  # inner box bytes must be <= the swizzle span ...
        isa.tensor_tile(g, (8, span), (0, 0), swizzle=swizzle)
    with pytest.raises(ValueError):  # ... and a multiple of 16 bytes
        isa.tensor_tile(g, (8, 4), (0, 0))


def test_tensor_store_inverts_load_and_skips_oob():
    g = _rand((20, 64))
    smem = isa.tensor_tile(g, (16, 64), (8, 0), swizzle="128B")
    out = np.full((20, 64), 7, np.float16)
    isa.tensor_store(out, (16, 64), (8, 0), smem, "128B")
    assert np.array_equal(out[8:], g[8:]) and np.all(out[:8] == 7)  # rows 20..23 of the box dropped
    wrong = np.full((20, 64), 7, np.float16)
    isa.tensor_store(wrong, (16, 64), (8, 0), smem, "none")
    assert not np.array_equal(wrong[8:], g[8:])


def test_tma_128b_tile_feeds_wgmma_k_major_and_mn_major_descriptors():
    """A TMA box written with swizzle S is what a wgmma descriptor with the same S reads (the CUTLASS use)."""
    a = _rand((64, 64))  # A, M x K, K contiguous: box (64 rows, 64 halves = 128 B)
    smem = isa.tensor_tile(a, (64, 64), (0, 0), swizzle="128B")
    for j in range(4):
        addr = isa.operand_addresses(64, 2, "K", "128B", lbo=16, sbo=1024, start=32 * j)
        assert np.array_equal(isa.load_operand(smem, addr, np.float16), a[:, 16 * j:16 * j + 16])
    b = _rand((16, 128))  # B, K x N, N contiguous: two boxes of (16, 64) at 0 and 2048 bytes
    smem = np.concatenate([isa.tensor_tile(b, (16, 64), (0, 64 * h), swizzle="128B") for h in range(2)])
    addr = isa.operand_addresses(128, 2, "MN", "128B", lbo=2048, sbo=1024)
    assert np.array_equal(isa.load_operand(smem, addr, np.float16), b.T)
    a64 = _rand((64, 32))
    smem = isa.tensor_tile(a64, (64, 32), (0, 0), swizzle="64B")
    for j in range(2):
        addr = isa.operand_addresses(64, 2, "K", "64B", lbo=16, sbo=512, start=32 * j)
        assert np.array_equal(isa.load_operand(smem, addr, np.float16), a64[:, 16 * j:16 * j + 16])
