"""CUDA graphs (README "CUDA graphs"): a decode step -- write the new token's K/V, then attend with a
fixed split -- is captured once and replayed step after step with new contents in the same device
arrays (cuda backend, skipped without a GPU). Without a GPU: the guards that turn what cannot be
captured (a host upload, a device read-back, split partials allocated and freed inside the call)
into errors naming the fix, through a fake ``cupy`` whose stream says it is capturing."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import _backend, reference, sim
from cupaged import attention as engine
from cupaged.testing import assert_close, tolerance
from tests import fake_cupy
from tests.conftest import gpu_available

NUM_SEQS, HEADS, KV_HEADS, HEAD, BLOCK, BLOCKS_PER_SEQ, SPLIT = 5, 8, 2, 128, 16, 24, 64


def _pool(rng):
    """Caches poisoned with NaN (a slot no token holds must never be read), a shuffled table, and
    each sequence's first tokens written."""
    shape = (NUM_SEQS * BLOCKS_PER_SEQ, BLOCK, KV_HEADS, HEAD)
    key_cache, value_cache = np.full(shape, np.nan, np.float16), np.full(shape, np.nan, np.float16)
    tables = rng.permutation(shape[0]).reshape(NUM_SEQS, BLOCKS_PER_SEQ).astype(np.int32)
    seq_lens = rng.integers(1, BLOCKS_PER_SEQ * BLOCK - 8, NUM_SEQS).astype(np.int32)
    for s, n in enumerate(seq_lens):
        slots = _slots(tables[s], np.arange(n))
        k, v = (rng.standard_normal((n, KV_HEADS, HEAD)).astype(np.float16) for _ in range(2))
        key_cache, value_cache = reference.reshape_and_cache_flash(k, v, key_cache, value_cache, slots)
    return key_cache, value_cache, tables, seq_lens


def _slots(table_row, positions):
    return (table_row[positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK).astype(np.int64)


def _step_inputs(rng, tables, seq_lens):
    """The next decode step: q and the new token's K/V per sequence, its slot, the grown lengths."""
    q = rng.standard_normal((NUM_SEQS, HEADS, HEAD)).astype(np.float16)
    k, v = (rng.standard_normal((NUM_SEQS, KV_HEADS, HEAD)).astype(np.float16) for _ in range(2))
    slots = np.array([_slots(tables[s], seq_lens[s:s + 1])[0] for s in range(NUM_SEQS)], np.int64)
    return q, k, v, slots, seq_lens + 1


@pytest.mark.skipif(not gpu_available(), reason="no GPU")
def test_a_decode_step_captures_and_replays():
    import cupy

    rng = np.random.default_rng(7)
    key_cache, value_cache, tables, seq_lens = _pool(rng)
    max_seq_len = BLOCKS_PER_SEQ * BLOCK
    d_kc, d_vc, d_tables = cupy.asarray(key_cache), cupy.asarray(value_cache), cupy.asarray(tables)
    host = _step_inputs(rng, tables, seq_lens)
    d_q, d_k, d_v, d_slots, d_lens = (cupy.asarray(a) for a in host)
    out = cupy.empty((NUM_SEQS, HEADS, HEAD), np.float16)
    kv = cupaged.KvView.paged(d_kc, d_vc, d_q)
    plan = cupaged.plan_attention(d_q, kv, d_tables, d_lens, max_seq_len=max_seq_len, kv_split_size=SPLIT)
    assert plan.max_splits > 1  # the step exercises the split partials and the merge kernel
    workspace = cupy.empty(plan.workspace_bytes, np.uint8)

    def step():
        cupaged.reshape_and_cache_flash(d_k, d_v, d_kc, d_vc, d_slots)
        cupaged.paged_attention(d_q, d_kc, d_vc, d_tables, d_lens, kv_split_size=SPLIT, max_seq_len=max_seq_len,
                                workspace=workspace, out=out)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()  # the warm-up: compiles, opts the kernel in for its shared memory, outside the capture
        stream.synchronize()
        d_kc.set(key_cache)  # undo the warm-up's write so the first replay starts from the pool above
        d_vc.set(value_cache)
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        for _ in range(3):
            q, k, v, slots, lens = host
            for dev, value in zip((d_q, d_k, d_v, d_slots, d_lens), host):
                dev.set(value)
            graph.launch(stream)
            stream.synchronize()
            key_cache, value_cache = reference.reshape_and_cache_flash(k, v, key_cache, value_cache, slots)
            want, _ = reference.paged_attention(q, key_cache, value_cache, tables, lens)
            assert_close(out.get(), want, tolerance(np.float16), "out")
            host = _step_inputs(rng, tables, lens)


def test_split_partials_need_a_workspace_while_capturing(monkeypatch):
    """On the sim, with the capture query forced: a split plan without workspace= is a ValueError
    (its partials would be freed while the graph still writes them); with one, it runs."""
    rng = np.random.default_rng(3)
    key_cache, value_cache, tables, seq_lens = _pool(rng)
    q = rng.standard_normal((NUM_SEQS, HEADS, HEAD)).astype(np.float16)
    args = (sim.asarray(q), sim.asarray(key_cache), sim.asarray(value_cache), tables, seq_lens)
    monkeypatch.setattr(engine, "capturing", lambda xp: True)
    with pytest.raises(ValueError, match=r"^workspace \(or partials\) is required while capturing"):
        cupaged.paged_attention(*args, kv_split_size=SPLIT)
    plan = cupaged.plan_attention(args[0], cupaged.KvView.paged(*args[1:3], args[0]), tables, seq_lens,
                                  kv_split_size=SPLIT)
    assert plan.workspace_bytes == cupaged.workspace_bytes(NUM_SEQS, HEADS, plan.max_splits, HEAD) > 0
    workspace = sim.zeros(plan.workspace_bytes, np.uint8)
    got = cupaged.paged_attention(*args, kv_split_size=SPLIT, workspace=workspace)
    assert_close(got, reference.paged_attention(q, key_cache, value_cache, tables, seq_lens)[0],
                 tolerance(np.float16), "out")
    unsplit = cupaged.plan_attention(args[0], cupaged.KvView.paged(*args[1:3], args[0]), tables, seq_lens,
                                     kv_split_size=0)
    assert unsplit.workspace_bytes == 0


def test_host_uploads_and_device_reads_are_errors_while_capturing(monkeypatch):
    cupy = fake_cupy.install(monkeypatch)
    sinks = np.zeros(HEADS, np.float32)
    assert isinstance(_backend.upload(cupy, sinks, "sinks"), cupy.ndarray)  # not capturing: uploaded
    assert _backend.host_copy(cupy.asarray(sinks)) is sinks
    cupy.capturing = True
    with pytest.raises(ValueError, match=r"^sinks is a host \(numpy\) array: pass it as a cupy array while capturing"):
        _backend.upload(cupy, sinks, "sinks")
    with pytest.raises(RuntimeError, match=r"validate=True .* CUDA graph capture forbids"):
        _backend.host_copy(cupy.asarray(sinks))
    device_sinks = cupy.asarray(sinks)
    assert _backend.upload(cupy, device_sinks, "sinks") is device_sinks  # device arrays pass while capturing
