"""Hostile files, a short budget of the fuzz harness (benchmarks/fuzz.py; its long run is in docs/reliability.md).

The .vflow/.cflow loader, the GGUF reader and the ONNX importer, 60 cases in worker subprocesses: no case may crash
a worker (a signal), hang, or end in anything but a CflowError or a working model. A failure names the case and the
command that replays it. The seed is fixed (CFLOW_FUZZ_SEED picks another); the long run is in docs/reliability.md.
The budget is a number of cases, not seconds (a time budget made the assertions below depend on how loaded the
host was: under load a 10 s budget once ran too few cases): a few seconds on a quiet 2-core host, after the bases
are built (the ONNX one is the preset's export the suite shares, tests/_shared.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests._shared import arch24_tiny_onnx

ROOT = Path(__file__).resolve().parents[2]


def test_fuzz_short_budget(tmp_path):
    seed = int(os.environ.get("CFLOW_FUZZ_SEED", "14"))
    out = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.fuzz", "--quick", "--cases", "60", "--seed", str(seed),
                        "--workers", "2", "--targets", "vflow,gguf,onnx", "--onnx-base", str(arch24_tiny_onnx()),
                        "--keep", str(tmp_path / "failures"), "--json", str(out)],
                       capture_output=True, text=True, env=dict(os.environ), timeout=900, cwd=ROOT)
    assert out.exists(), r.stderr[-3000:]
    d = json.loads(out.read_text())["records"][0]["extra"]  # the run as one record (benchmarks/common/record.py)
    failures = "\n".join(f"{f['outcome']}: {f['kind']}: {f['desc']}: {f['detail']} -> {f['replay']}"
                         for f in d["failures"])
    assert d["crashes"] == d["hangs"] == d["bugs"] == 0, failures
    assert r.returncode == 0, r.stderr[-3000:]
    assert d["cases"] == 60 and d["outcomes"].get("rejected", 0) > 0 and d["outcomes"].get("loaded", 0) > 0, d
    assert set(d["targets"]) == {"vflow", "gguf", "onnx"}
    assert {k.split(":")[0] for k in d["by_kind"]} >= {"gguf", "onnx"}, d["by_kind"]  # each reader got cases
