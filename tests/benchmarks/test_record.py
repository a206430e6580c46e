"""benchmarks/common/record.py: every record has the schema's keys in order, the writer refuses anything else, the
reader takes the schema's files and older ones, and the default folder is named after the host kind."""

import json
import os
import re

import pytest

from benchmarks.common import ROOT, record
from benchmarks.common.record import FIELDS, Run, load_results


def test_record_has_the_schema_keys():
    from cflow.codegen.target import cpu_model, isa_path

    run = Run("decode", ["--threads", "2", "--note", "a b"])
    r = run.record(engine="cflow", model="g", quant="q4", threads=2, tok_s=12.5, bytes_per_token=1000.0,
                   read_gbs=30, other_load=0.05)
    assert tuple(r) == FIELDS
    assert r["extra"] == {"other_load": 0.05} and r["variant"] is None
    assert (r["threads"], r["tok_s"], r["bytes_per_token"], r["read_gbs"]) == (2, 12.5, 1000, 30.0)
    assert r["isa_path"] == isa_path() and r["cpu_model"] == cpu_model()  # the ISA path in use, "(forced: ...)"
    assert r["command"] == "python -m benchmarks.decode --threads 2 --note 'a b'"  # pastes as it ran
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r["date"])
    assert r["commit"] is None or re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", r["commit"])
    assert run.record(isa_path=None)["isa_path"] is None  # a figure no cflow kernel made
    none = run.record()
    assert all(none[k] is None for k in ("engine", "model", "quant", "threads", "tok_s", "bytes_per_token"))


def test_write_and_read_back(tmp_path):
    run = Run("fuzz", [])
    recs = [run.record(engine="cflow", isa_path=None, cases=3), run.record(engine="x", isa_path=None, v=[1, 2])]
    path = run.write(str(tmp_path / "sub" / "r.json"), recs, {"summary": {1: 2}})
    doc = json.loads(open(path).read())
    assert doc["schema"] == record.SCHEMA and doc["extra"] == {"summary": {"1": 2}}
    assert load_results(path) == (doc["records"], doc["extra"]) and doc["records"] == recs
    assert run.write(None, recs) is None  # no --json: nothing written
    with pytest.raises(ValueError):
        run.write(str(tmp_path / "bad.json"), [{"engine": "cflow", "tok_s": 1.0}])
    assert not (tmp_path / "bad.json").exists()


def test_json_argument_without_file_is_the_default_path(monkeypatch):
    import argparse

    ap = argparse.ArgumentParser()
    record.add_json_argument(ap)
    assert ap.parse_args([]).json is None and ap.parse_args(["--json"]).json == ""
    assert ap.parse_args(["--json", "x.json"]).json == "x.json"
    monkeypatch.setattr(record, "host_kind", lambda: "znver9")
    path = record.default_path("decode", "2025-03-04T05:06:07Z")
    assert path == os.path.join(ROOT, "docs", "results", "znver9", "decode-20250304-050607.json")


def test_host_kind_is_a_folder_name(monkeypatch):
    kind = record.host_kind()
    assert kind and re.fullmatch(r"[a-z0-9][a-z0-9._-]*", kind)
    from cflow.codegen import target, tune_defaults

    monkeypatch.setattr(tune_defaults, "host_family", lambda: "generic")
    monkeypatch.setattr(target, "cpu_name", lambda: "AMD EPYC 7763 64-Core Processor")
    assert record.host_kind() == "amd-epyc-7763-64-core-processor"
    monkeypatch.setattr(tune_defaults, "host_family", lambda: "znver5")
    assert record.host_kind() == "znver5"


def test_older_files_are_read_into_the_schema(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"engine": "llama.cpp", "geometry": "g", "quant": "Q4_0", "threads": 2,
                                "tok_s": 9.0, "bytes_per_token": 10, "read_gbps": 20.0, "isa": "avx2",
                                "other_load": 0.1}]))
    (r,), top = load_results(str(old))
    assert tuple(r) == FIELDS and top == {}
    assert (r["engine"], r["model"], r["read_gbs"], r["isa_path"], r["extra"]) == (
        "llama.cpp", "g", 20.0, "avx2", {"other_load": 0.1})
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"cpu": "some CPU", "records": [{"threads": 1, "tok_s": 3.0}]}))
    (r,), top = load_results(str(wrapped))
    assert r["cpu_model"] == "some CPU" and top == {"cpu": "some CPU"} and r["tok_s"] == 3.0
