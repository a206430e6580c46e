"""kv_blocks: a span of positions copied out of one slot and into another is exactly attention.kv_layout's entries
of those positions, and a slot restored from another's prefix continues bit for bit as if it had read the whole
prompt itself."""

from types import SimpleNamespace

import numpy as np
import pytest

import cflow
from cflow.codegen.abi import kv_floats_per_layer
from cflow.codegen.attention import kv_layout
from cflow.errors import CflowError
from cflow.runtime.kv_blocks import KVSpans

PROMPT = [(11 * i) % 250 + 1 for i in range(53)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph

    path = tmp_path_factory.mktemp("kv_blocks") / "tiny.vflow"
    compile_file(load_graph("preset:arch2_4_combined@tiny"), path, "q4")
    return str(path)


def _fake_session(max_seq: int, kv: str, layers=3, heads=2, head_dim=8, slots=2):
    cfg = SimpleNamespace(n_layers=layers, n_kv_heads=heads, head_dim=head_dim)
    n = slots * 2 * layers * kv_floats_per_layer(cfg, max_seq)
    return SimpleNamespace(config=cfg, max_seq=max_seq, kv_dtype=kv, kv=np.arange(n, dtype=np.float32),
                           _check_slot=lambda s: s, native=SimpleNamespace(wait=lambda: None))  # no step in flight


@pytest.mark.parametrize("max_seq,kv", [(64, "f32"), (64, "bf16"), (40, "f16"), (12, "f32"), (7, "bf16"),
                                        (7, "f32")])
def test_spans_are_the_layouts_entries(max_seq, kv):
    """read() of aligned positions [lo, hi) returns, for every layer, K|V and kv head, the entries kv_layout puts
    those positions at (the cache holds its own offsets, so the values name the entries), in position order
    of a contiguous run."""
    s = _fake_session(max_seq, kv)
    spans = KVSpans(s)
    cfg, per = s.config, kv_floats_per_layer(s.config, max_seq)
    k_at, v_at = kv_layout(max_seq, cfg.n_kv_heads, cfg.head_dim, kv)
    a = spans.align
    for slot in (0, 1):
        for lo, hi in ((0, a), (a, 3 * a), (0, max_seq - max_seq % a)):
            if not lo < hi <= max_seq:
                continue
            got = spans.read(slot, lo, hi)
            for which, at in ((0, k_at), (1, v_at)):
                for layer in range(cfg.n_layers):
                    base = (slot * cfg.n_layers * 2 + layer * 2 + which) * per
                    for g in range(cfg.n_kv_heads):
                        want = {base + at(p, g, d) for p in range(lo, hi) for d in range(cfg.head_dim)}
                        assert set(got[which, layer, g].astype(np.int64).tolist()) == want
    # writing a span back puts every entry where it came from, in another slot
    blk = spans.read(0, 0, a)
    spans.write(1, 0, blk)
    assert np.array_equal(spans.read(1, 0, a), blk)
    if a > 1:
        with pytest.raises(CflowError, match="multiples of"):
            spans.read(0, 1, a + 1)
    with pytest.raises(CflowError, match="does not fit"):
        spans.write(0, 0, blk[:, :1])


@pytest.mark.parametrize("kv", ["auto", "bf16"])
def test_restored_prefix_continues_bit_for_bit(tiny_path, kv):
    """Slot 0 reads the whole prompt; slot 1 gets its first 32 positions' keys and values copied in, reads only the
    rest, and gives the same logits bit for bit, then the same logits step after step (batched, and in slot 0 with
    the single-sequence decode step after a restore there)."""
    with cflow.load(tiny_path, threads=1, max_batch=2, prefill_block=8, kv=kv) as m:
        s = m.session
        spans = KVSpans(s)
        whole = m.batch_start(PROMPT, 0)
        blocks = [spans.read(0, lo, lo + 16) for lo in (0, 16)]
        m.batch_start([3, 1, 4, 1, 5], 1)  # slot 1 held another sequence before
        assert spans.restore(1, blocks) == 32 and s.slot_pos[1] == 32 and s.slot_open[1]
        part = m.batch_extend(PROMPT[32:], 1)  # 21 tokens: calls of 8, 8, 5 where slot 0 had 8 x 6 + 5
        assert np.array_equal(whole, part)
        for tok in (7, 9, 200):
            rows = m.batch_step([tok, tok], [0, 1])
            assert np.array_equal(rows[0], rows[1])
        # slot 0 restored from slot 1's copy of 48 positions: the decode step continues as slot 1 does
        spans.restore(0, [spans.read(1, 0, 48)])
        m.batch_extend(PROMPT[48:] + [7, 9, 200], 0)
        one = s.step(11).copy()
        assert np.array_equal(one, m.batch_step([11], [1])[0])
        with pytest.raises(CflowError, match="resume at position"):
            s.resume(1, s.max_seq)


def test_a_block_size_the_layout_cannot_copy(tiny_path):
    with cflow.load(tiny_path, threads=1, max_batch=2, prefill_block=8) as m:
        spans = KVSpans(m.session)
        assert spans.align == 16  # context 128: K blocks of 16 positions
        assert spans.nbytes(16) == spans.read(0, 0, 16).nbytes
