"""The ops' declared minimum traffic and FLOPs (cupaged/_cost.py) on sizes counted by hand, and the
NVTX ranges the ops emit under CUPAGED_NVTX=1."""

from __future__ import annotations

import contextlib
import sys
import types

import numpy as np
import pytest

import cupaged
from cupaged import sim
from cupaged._cost import attention_cost, visible_pairs


def test_decode_cost_by_hand():
    # 2 sequences of 5 and 3 keys, 4 query heads over 2 KV heads, head 8, fp16 everywhere, blocks of 4:
    # K/V 8 keys x 2 heads x 16 values x 2 B = 512; q + out 2 tokens x 4 heads x 32 B = 256;
    # tables (2 + 1 blocks) x 4 = 12; 2 seq_lens x 4 = 8 (a decode reads no query_start_loc; a
    # prefill's 3 entries add 12)
    kw = dict(num_heads=4, num_kv_heads=2, head_size=8, v_head_size=8, kv_itemsize=2, q_itemsize=2, out_itemsize=2,
              block_size=4, causal=True)
    c = attention_cost([5, 3], [1, 1], **kw, query_start_loc=False)
    assert c.min_bytes == 512 + 256 + 12 + 8
    assert attention_cost([5, 3], [1, 1], **kw).min_bytes == c.min_bytes + 12
    assert c.flops == 2 * 16 * 4 * (5 + 3)


@pytest.mark.parametrize("window, keys, pairs", [
    ((-1, 0), 10, 7 + 8 + 9 + 10),   # causal: queries at positions 6..9 see keys 0..p
    ((2, 0), 6, 4 * 3),              # each sees its 3 most recent keys; together keys 4..9
    ((7, 0), 10, 7 + 8 + 8 + 8),     # positions 6..9: min(p + 1, 8)
    ((-1, -1), 10, 4 * 10),
    ((1, 1), 5, 3 + 3 + 3 + 2),      # p - 1 .. p + 1 within 0..9: keys 5..9
    ((0, 2), 4, 3 + 3 + 2 + 1),      # p .. p + 2: keys 6..9
])
def test_visible_pairs_of_a_prefill_chunk(window, keys, pairs):
    k, p = visible_pairs([10], [4], window)
    assert (int(k[0]), int(p[0])) == (keys, pairs)


def test_mla_reads_a_latent_row_once():
    c = attention_cost([4], [1], num_heads=16, num_kv_heads=1, head_size=576, v_head_size=512, kv_itemsize=2,
                       q_itemsize=2, out_itemsize=2, block_size=64, causal=True, lse=True, shared_kv=True,
                       query_start_loc=False)
    assert c.min_bytes == 4 * 576 * 2 + 16 * (576 * 2 + 512 * 2 + 4) + 4 + 4
    assert c.flops == 2 * (576 + 512) * 16 * 4


@pytest.fixture
def fake_nvtx(monkeypatch):
    """An ``nvtx`` module that records the ranges opened (the real one needs a GPU profiler)."""
    opened = []

    @contextlib.contextmanager
    def annotate(message, **_):
        opened.append(message)
        yield

    monkeypatch.setitem(sys.modules, "nvtx", types.SimpleNamespace(annotate=annotate))
    return opened


def _decode():
    rng = np.random.default_rng(0)
    kc = sim.asarray(rng.standard_normal((4, 16, 2, 64)).astype(np.float16))
    vc = sim.asarray(rng.standard_normal((4, 16, 2, 64)).astype(np.float16))
    q = rng.standard_normal((2, 4, 64)).astype(np.float16)
    cupaged.paged_attention(q, kc, vc, np.array([[0, 1], [2, 3]], np.int32), np.array([20, 31], np.int32))


def test_ops_emit_nvtx_ranges_only_when_asked(fake_nvtx, monkeypatch):
    monkeypatch.delenv("CUPAGED_NVTX", raising=False)
    _decode()
    assert fake_nvtx == []
    monkeypatch.setenv("CUPAGED_NVTX", "1")
    _decode()
    assert fake_nvtx == ["cupaged.decode b=2 t=2 h=4/2 d=64 fp16 causal splits=1"]
