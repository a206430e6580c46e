"""benchmarks.blockdot_ab: a type's kernel compiled from two versions of codegen/blockdot.py, timed side by side."""

import json
from pathlib import Path

from benchmarks import blockdot_ab
from cflow.codegen import blockdot
from cflow.codegen import kernels as K
from cflow.layout.quant import DType
from tests.benchmarks._blockdot_versions import without_q3k_combine


def test_times_both_versions_and_restores_the_module(tmp_path, capsys):
    old = tmp_path / "old.py"
    old.write_text(Path(blockdot.__file__).read_text())
    out = tmp_path / "r.json"
    assert blockdot_ab.main([str(old), "--types", "Q4_0,Q3_K", "--threads", "1", "--rounds", "1",
                             "--set-gb", "0.002", "--json", str(out)]) == 0
    assert "new / old" in capsys.readouterr().out
    recs = json.loads(out.read_text())["records"]
    assert {(r["quant"], r["variant"]) for r in recs} == {(q, f"blockdot {v}") for q in ("Q4_0", "Q3_K")
                                                          for v in ("old", "new")}
    assert K.blockdot is blockdot  # the emitter calls the tree's decoder again


def test_each_version_builds_its_own_kernel(tmp_path):
    """The swap reaches the emitter: a copy without Q3_K's integer combine makes other IR than the tree's."""
    old = without_q3k_combine(tmp_path / "old.py")
    versions = {"old": blockdot_ab.load_version(str(old), "blockdot_test_old"), "new": blockdot}
    cases = blockdot_ab.build([DType.Q3_K], versions, 0.002, 1)
    ir_old, ir_new = (c.mv.library.get_source_str() for _, _, c in cases)
    assert ir_old != ir_new and cases[0][2].buf is cases[1][2].buf  # other kernels over the same copies
    assert K.blockdot is blockdot
