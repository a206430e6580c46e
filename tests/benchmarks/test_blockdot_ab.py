"""benchmarks.blockdot_ab: a type's kernel compiled from two versions of codegen/blockdot.py, timed side by side."""

import json
from pathlib import Path

from benchmarks import blockdot_ab
from cflow.codegen import blockdot
from cflow.codegen import kernels as K


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
