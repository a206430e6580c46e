"""benchmarks.stream_work runs end to end on small buffers and its loops compute what they claim (nothing is
optimised away: the result depends on the data)."""

import json

import numpy as np

from benchmarks import stream_work
from cflow.codegen.target import host_target
from cflow.layout.tile import aligned_empty


def test_alu_loop_with_no_ops_is_the_xor_of_the_data():
    f = stream_work.build("alu", 0, host_target())
    x = aligned_empty(4096).view(np.uint64)  # the loop's loads are 64-byte aligned
    x[:] = np.random.default_rng(0).integers(0, 2**63, x.size, dtype=np.uint64)
    # the read loop's result (codegen.bandwidth.read_xor): the XOR of every 64-bit word
    assert f(x.ctypes.data, x.nbytes) & (2**64 - 1) == int(np.bitwise_xor.reduce(x))


def test_stream_work_runs(tmp_path):
    out = tmp_path / "s.json"
    recs = stream_work.main(["--ops", "0,2", "--rounds", "1", "--lines", "8,12", "--kind", "alu,indep",
                             "--dram-bytes", str(1 << 20), "--l2-bytes",
                             str(64 << 10), "--json", str(out)])
    assert recs and all(r["extra"]["dram_gbps"] > 0 and r["extra"]["l2_gbps"] > 0 for r in recs)
    assert json.loads(out.read_text())["records"] == recs
