"""Container format: round trip, layout flag, expert access, atomic writes, and each validation rule."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from cflow.errors import CflowError, FormatError
from cflow.layout.quant import DType
from cflow.runtime.format import FileReader, FileWriter
from cflow.runtime.format import spec as F
from cflow.runtime.format.header import written_by

from . import HEADER, Container, write_sample

T = Container.T


@pytest.fixture
def sample(tmp_path):
    path = tmp_path / "model.vflow"
    return path, write_sample(path)


def rewrite(path, edit) -> None:
    c = Container(path.read_bytes())
    edit(c)
    path.write_bytes(c.tobytes())


def open_fails(path, *needles) -> str:
    with pytest.raises(FormatError) as ei:
        FileReader(path)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, msg
    return msg


# -- round trip -----------------------------------------------------------------------------
def test_round_trip(sample):
    path, tensors = sample
    with FileReader(path) as r:
        # tuples come back as lists; the writer stamps who wrote the file (cflow, format and plan versions)
        assert r.header == {**written_by(), **json.loads(json.dumps(HEADER))}
        assert r.layout == "vflow" and r.version == F.VERSION
        assert [t.name for t in r.tensors] == [t[0] for t in tensors]  # table order = data order
        for (name, dtype, shape, data, kw), e in zip(tensors, r.tensors):
            assert (e.dtype, e.shape) == (dtype, shape)
            assert e.layer == kw.get("layer", -1) and e.expert == kw.get("expert", -1)
            assert e.stage == kw.get("stage", -1)
            assert e.file_offset % F.ALIGN == 0
            got = r.tensor(name)
            if len(shape) == 1:
                assert got.dtype == np.float32 and np.array_equal(got, data)
            else:
                assert got.dtype == np.uint8 and bytes(got) == data.tobytes()
                assert e.tile == kw["tile"]
        assert not r.tensor("norm").flags.writeable
        r.verify()
        assert r.verified == "ok"
    assert not list(path.parent.glob(".*.tmp"))


@pytest.mark.parametrize("name,layout,want", [
    ("m.cflow", None, "cflow"), ("m.vflow", None, "vflow"), ("m.bin", "cflow", "cflow"), ("m.bin", "vflow", "vflow")])
def test_layout_flag(tmp_path, name, layout, want):
    write_sample(tmp_path / name, layout)
    with FileReader(tmp_path / name) as r:
        assert r.layout == want
    flags = F.PREAMBLE.unpack_from((tmp_path / name).read_bytes())[2]
    assert flags == (F.FLAG_VFLOW if want == "vflow" else 0)


def test_layout_required_for_unknown_extension(tmp_path):
    with pytest.raises(FormatError, match="layout"):
        FileWriter(tmp_path / "m.bin", {})


def test_empty_container(tmp_path):
    with FileWriter(tmp_path / "e.cflow", {"a": 1}):
        pass
    with FileReader(tmp_path / "e.cflow") as r:
        assert r.tensors == [] and r.experts == [] and r.header == {**written_by(), "a": 1}
        r.verify()


def test_chunked_checksums(tmp_path, monkeypatch):
    # Small chunks exercise the multi-chunk paths big (multi-GB) tensors take.
    monkeypatch.setattr(F, "CRC_CHUNK", 1000)
    write_sample(tmp_path / "m.vflow")
    seen = []
    with FileReader(tmp_path / "m.vflow") as r:
        r.verify(progress=lambda done, total: seen.append((done, total)))
        assert seen[-1][0] == seen[-1][1] == r.data_len
        assert len(seen) > len(r.tensors) * 2


def test_summary(sample):
    path, _ = sample
    with FileReader(path) as r:
        assert "checksums: not verified" in r.summary()
        r.verify()
        text = r.summary()
    for needle in ("layout vflow (stage-major)", "layers.1.experts.1.w2", "checksums: ok", "layer   1: 2 experts",
                   "tokenizer: <string"):
        assert needle in text, text


# -- experts ---------------------------------------------------------------------------------
def test_read_expert_touches_only_its_ranges(sample):
    path, _ = sample
    touched = []
    orig = FileReader._view

    def spy(self, off, n):
        touched.append((off, n))
        return orig(self, off, n)

    FileReader._view = spy
    try:
        r = FileReader(path)
        assert touched == [], "opening must not touch tensor data"
        ranges = r.expert_ranges(1, 0)
        views = r.read_expert(1, 0, verify=True)
    finally:
        FileReader._view = orig
    mine = [t for t in r.tensors if (t.layer, t.expert) == (1, 0)]
    assert touched == [(t.file_offset, t.nbytes) for t in mine] == [(x.file_offset, x.nbytes) for x in ranges]
    assert [bytes(v) for v in views] == [bytes(r.tensor(t.name)) for t in mine]
    assert r.experts == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(KeyError, match="expert 5"):
        r.expert_ranges(0, 5)


def test_read_expert_verify_finds_corruption(sample):
    path, _ = sample
    with FileReader(path) as r:
        victim = r.expert_ranges(0, 1)[1]
    blob = bytearray(path.read_bytes())
    blob[victim.file_offset + 7] ^= 0x40
    path.write_bytes(blob)
    with FileReader(path) as r:
        r.read_expert(0, 0, verify=True)  # a neighbour still verifies on its own
        with pytest.raises(FormatError, match=r"layer 0 expert 1 range 1: checksum mismatch"):
            r.read_expert(0, 1, verify=True)


def test_expert_range_rules(sample):
    path, _ = sample
    blob = path.read_bytes()
    cases = {
        "not inside one tensor": lambda c: c.ranges[0].__setitem__(1, c.ranges[0][1] + 1),
        "lies in tensor": lambda c: c.ranges.__setitem__(0, c.ranges[2][:]) or c.ranges.__setitem__(2, c.ranges[0][:]),
        "sorted by (layer, expert)": lambda c: c.experts[1].__setitem__(1, 0),  # (0, 0) twice
        "differs from tensor": lambda c: c.ranges[0].__setitem__(2, 1234),
        "must continue at": lambda c: c.experts[1].__setitem__(2, 0),
        "no entry for": lambda c: (c.experts.pop(), [c.ranges.pop() for _ in range(2)]),
    }
    for needle, edit in cases.items():
        c = Container(blob)
        edit(c)
        path.write_bytes(c.tobytes())
        open_fails(path, needle, "expert table")


# -- atomic writes ---------------------------------------------------------------------------
def test_exception_leaves_nothing(tmp_path):
    path = tmp_path / "m.cflow"
    with pytest.raises(RuntimeError), FileWriter(path, HEADER) as w:
        w.add_tensor("v", DType.F32, (4,), np.zeros(4, np.float32))
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_exception_keeps_existing_file(tmp_path):
    path = tmp_path / "m.cflow"
    path.write_bytes(b"precious")
    with pytest.raises(FormatError, match="duplicate"), FileWriter(path, HEADER) as w:
        w.add_tensor("v", DType.F32, (4,), np.zeros(4, np.float32))
        w.add_tensor("v", DType.F32, (4,), np.zeros(4, np.float32))
    assert path.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == ["m.cflow"]


def test_unwritable_target_is_a_clear_error(tmp_path):
    with pytest.raises(CflowError, match="directory .* does not exist"):
        FileWriter(tmp_path / "no" / "m.cflow", HEADER).open()
    (tmp_path / "d.cflow").mkdir()
    with pytest.raises(CflowError, match="d.cflow is a directory"):
        write_sample(tmp_path / "d.cflow")
    assert [p.name for p in tmp_path.iterdir()] == ["d.cflow"]


def test_replaces_existing_file_and_mode(tmp_path):
    path = tmp_path / "m.cflow"
    path.write_bytes(b"old")
    write_sample(path)
    FileReader(path).verify()
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def test_writer_state_machine(tmp_path):
    w = FileWriter(tmp_path / "m.cflow", {})
    with pytest.raises(FormatError, match="state 'new'"):
        w.add_tensor("v", DType.F32, (4,), np.zeros(4, np.float32))
    w.open()
    with pytest.raises(FormatError, match="state 'tensors'"):
        w.open()
    w.close()
    w.close()  # idempotent
    with pytest.raises(FormatError, match="state 'done'"):
        w.add_tensor("v", DType.F32, (4,), np.zeros(4, np.float32))


def test_writer_dropped_without_close_leaves_no_temp(tmp_path):
    w = FileWriter(tmp_path / "m.cflow", {}).open()
    assert len(list(tmp_path.iterdir())) == 1
    del w
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,needle", [
    (("w", DType.Q4, (64, 64), np.zeros(10, np.uint8)), "needs"),  # nbytes inconsistent with shape
    (("w", DType.Q4, (64,), np.zeros(64, np.float32)), "f32 vectors"),
    (("w", DType.F32, (0, 4), np.zeros(0, np.float32)), "dim outside"),
    (("w", DType.F32, (4, 4), np.zeros((4, 8), np.float32)[:, ::2]), "C-contiguous"),
    (("", DType.F32, (4,), np.zeros(4, np.float32)), "non-empty"),
    (("w", "q5", (4,), np.zeros(4, np.float32)), "unknown quantisation"),
])
def test_writer_rejects(tmp_path, args, needle):
    with FileWriter(tmp_path / "m.cflow", {}) as w:
        with pytest.raises(FormatError, match=needle):
            w.add_tensor(*args, tile=(1, 1))
        w.add_tensor("ok", DType.F32, (4,), np.zeros(4, np.float32))  # still usable after a rejection
    assert [t.name for t in FileReader(tmp_path / "m.cflow").tensors] == ["ok"]


def test_writer_rejects_bad_header_and_expert_without_layer(tmp_path):
    with pytest.raises(FormatError, match="JSON"):
        FileWriter(tmp_path / "m.cflow", {"x": object()})
    with FileWriter(tmp_path / "m.cflow", {}) as w, pytest.raises(FormatError, match="needs a layer"):
        w.add_tensor("e", DType.F32, (4,), np.zeros(4, np.float32), expert=0)


# -- validation on open ----------------------------------------------------------------------
def test_bad_magic(sample):
    path, _ = sample
    blob = bytearray(path.read_bytes())
    blob[:8] = b"GGUF\x03\x00\x00\x00"
    path.write_bytes(blob)
    open_fails(path, "magic", "not a .cflow/.vflow file", "file offset 0x0")


def test_unknown_version(sample):
    path, _ = sample
    c = Container(path.read_bytes())
    c.pre["version"] = F.VERSION + 1
    path.write_bytes(c.tobytes())
    open_fails(path, "compiled by a cflow of format 2", "recompile with cflowc")


def test_missing_and_tiny_files(tmp_path):
    open_fails(tmp_path / "nope.vflow", "cannot open")
    (tmp_path / "empty.vflow").write_bytes(b"")
    open_fails(tmp_path / "empty.vflow", "shorter than")


def test_truncation_at_many_points(sample):
    path, _ = sample
    blob = path.read_bytes()
    cut = path.with_name("cut.vflow")
    points = sorted(set(range(0, len(blob), 331)) | {1, 8, 127, 128, 4095, 4096, len(blob) - 1})
    for n in points:
        cut.write_bytes(blob[:n])
        open_fails(cut, str(cut))


def test_preamble_checksum(sample):
    path, _ = sample
    c = Container(path.read_bytes())
    c.overrides["data_len"] = c.pre["data_len"] + F.ALIGN
    path.write_bytes(c.tobytes(fix_crcs=False))
    open_fails(path, "preamble_crc")


@pytest.mark.parametrize("field,value,needle", [
    ("offset", 4096 + 8, "not a multiple of 4096"),
    ("offset", 0, "overlaps the previous tensor"),
    ("offset", 2**64 - 4096, "exceeds the data section size"),
    ("nbytes", 12, "inconsistent"),
    ("nbytes", 2**64 - 1, "inconsistent"),
    ("dtype", 3, "not a known dtype"),
    ("ndim", 9, "ndim 9"),
    ("shape0", 2**32, "dim outside"),
    ("tile0", 0, "tile"),
    ("name_len", 10**6, "names pool"),
    ("stage", -5, "negative"),
])
def test_tensor_table_lies(sample, field, value, needle):
    path, _ = sample
    rewrite(path, lambda c: c.tensors[2].__setitem__(T[field], value))
    msg = open_fails(path, needle, "tensor table entry 2", "file offset 0x")
    if field not in ("name_len",):
        assert "'layers.0.attn.wqkv'" in msg


def test_shape_product_overflow(sample):
    path, _ = sample

    def edit(c):
        t = c.tensors[2]
        t[T["ndim"]] = 4
        t[T["shape0"]:T["shape3"] + 1] = [2**31 - 1] * 4
    rewrite(path, edit)
    open_fails(path, "more than 2**48 elements")


def test_duplicate_names(sample):
    path, _ = sample

    def edit(c):
        c.tensors[3][T["name_off"]] = c.tensors[1][T["name_off"]]
        c.tensors[3][T["name_len"]] = c.tensors[1][T["name_len"]]
    rewrite(path, edit)
    open_fails(path, "duplicate name (also entry 1)", "tensor table entry 3")


def test_header_lies(sample):
    path, _ = sample
    for header, needle in ((b"[1, 2]", "JSON object"), (b"\xff{}", "UTF-8"), (b"[" * 100000, "JSON"),
                           (b'{"a": ' + b"1" * 5000 + b"}", "JSON")):
        rewrite(path, lambda c, header=header: setattr(c, "header", header))
        open_fails(path, "header:", needle)


def test_nonzero_header_padding(sample):
    path, _ = sample
    blob = bytearray(path.read_bytes())
    blob[F.ALIGN - 1] = 1  # last byte before the data section
    path.write_bytes(blob)
    open_fails(path, "header padding", "0xfff")


def test_index_length_lies(sample):
    path, _ = sample
    for field, value, needle in (("n_tensors", 2**32 - 1, "counts"), ("index_len", 2**64 - 1, "index_len"),
                                 ("header_len", 2**63, "header_len"), ("file_len", 2**64 - 1, "truncated"),
                                 ("data_offset", 0, "data_offset"), ("align", 512, "align"),
                                 ("flags", 6, "unknown flag")):
        c = Container(path.read_bytes())
        c.overrides[field] = value
        bad = path.with_name("bad.vflow")
        bad.write_bytes(c.tobytes())
        open_fails(bad, field if field != "file_len" else "file_len", needle)


def test_custom_nbytes_hook(sample):
    path, _ = sample
    with pytest.raises(FormatError, match="nbytes .* expected 1"):
        FileReader(path, expected_nbytes=lambda dtype, shape, tile: 1)


# -- verify() --------------------------------------------------------------------------------
def test_verify_names_corrupt_tensor(sample):
    path, _ = sample
    with FileReader(path) as r:
        t = r.entry("layers.1.attn.wqkv")
    blob = bytearray(path.read_bytes())
    blob[t.file_offset + t.nbytes // 2] ^= 1
    path.write_bytes(blob)
    with FileReader(path) as r:  # structure is fine: opening succeeds
        with pytest.raises(FormatError, match=rf"tensor {t.index} \('layers.1.attn.wqkv'\): data checksum "
                                              rf"mismatch.*file offset 0x{t.file_offset:x}"):
            r.verify()
        assert "FAILED" in r.summary()


def test_verify_finds_nonzero_padding(sample):
    path, _ = sample
    with FileReader(path) as r:
        t = r.entry("layers.0.attn_norm")
        data_end = r.index_offset
    for pos, needle in ((t.file_offset + t.nbytes + 5, "after tensor 1 ('layers.0.attn_norm')"),
                        (data_end - 1, "after tensor")):
        blob = bytearray(path.read_bytes())
        blob[pos] = 0x80
        p2 = path.with_name("pad.vflow")
        p2.write_bytes(blob)
        with FileReader(p2) as r, pytest.raises(FormatError, match="padding") as ei:
            r.verify()
        assert needle in str(ei.value) and f"0x{pos:x}" in str(ei.value)


def test_closed_reader(sample):
    path, _ = sample
    r = FileReader(path)
    v = r.tensor("norm")
    r.close()
    assert float(v[0]) == 1.0  # views outlive the reader
    with pytest.raises(FormatError, match="closed"):
        r.tensor("norm")


def _odd_tensors(n=30):
    rng = np.random.default_rng(7)
    return [(f"t{i}", rng.standard_normal(int(k)).astype(np.float32)) for i, k in enumerate(rng.integers(1, 9000, n))]


def _write(path, tensors, **kw) -> bytes:
    with FileWriter(path, HEADER, **kw) as w:
        for name, a in tensors:
            w.add_tensor(name, DType.F32, a.shape, a)
    return path.read_bytes()


def test_direct_writes_are_the_buffered_bytes(tmp_path, monkeypatch):
    """The tensors written with O_DIRECT (staging buffers of two blocks: most tensors cross one) make the very file
    the buffered writes make; where O_DIRECT is refused, the buffered writes run."""
    from cflow.runtime.format import direct

    monkeypatch.setattr(direct, "BUFFER_BYTES", 2 * F.ALIGN)
    tensors = _odd_tensors()
    buffered = _write(tmp_path / "b.cflow", tensors, direct=False)
    with FileWriter(tmp_path / "probe.cflow", HEADER) as w:
        if w._direct is None:
            pytest.skip("this file system refuses O_DIRECT")
    assert _write(tmp_path / "d.cflow", tensors) == buffered
    with FileReader(tmp_path / "d.cflow") as r:
        r.verify()
    monkeypatch.setattr(direct.DirectAppender, "open", classmethod(lambda cls, path, offset, b=None: None))
    assert _write(tmp_path / "f.cflow", tensors) == buffered


def test_direct_write_failure_leaves_nothing(tmp_path, monkeypatch):
    """A write that fails in the O_DIRECT thread (a full disk) is raised in the writer, which leaves no file."""
    from cflow.runtime.format import direct

    monkeypatch.setattr(direct, "BUFFER_BYTES", F.ALIGN)

    def full(self, buf, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(direct.DirectAppender, "_pwrite", full)
    with pytest.raises(OSError, match="No space"), FileWriter(tmp_path / "m.cflow", HEADER) as w:
        if w._direct is None:
            pytest.skip("this file system refuses O_DIRECT")
        for name, a in _odd_tensors(4):
            w.add_tensor(name, DType.F32, a.shape, a)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("start", [0, 1, 4095, 4096, 5000])
def test_direct_file_appends_the_written_bytes(tmp_path, monkeypatch, start):
    """DirectFile (the GGUF writer's data section): from any start, through writes of any size (staging buffers of
    two blocks), the file holds the head before `start` and then exactly the bytes written, at its true length;
    abort stops without raising."""
    from cflow.runtime.format import direct

    monkeypatch.setattr(direct, "BUFFER_BYTES", 2 * F.ALIGN)
    rng = np.random.default_rng(start)
    head = rng.integers(0, 256, start, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(head)
    f = direct.DirectFile.open(str(path), start)
    if f is None:
        pytest.skip("this file system refuses O_DIRECT")
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (3, 8192, 1, 12289, 0, 700)]
    for p in parts:
        assert f.write(p) == len(p)
    assert f.tell() == start + sum(map(len, parts))
    f.flush()
    f.close()
    f.close()
    assert path.read_bytes() == head + b"".join(parts)
    g = direct.DirectFile.open(str(path), 10)
    g.write(b"x" * 5)
    g.abort()
    with pytest.raises(ValueError, match="shorter"):
        direct.DirectFile.open(str(path), 10**9)
