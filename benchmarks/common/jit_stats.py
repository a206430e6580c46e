"""A pytest plugin (`-p benchmarks.common.jit_stats`) that records every JIT library the tests finalize: one JSON
line per Library.finalize to the file CFLOW_JIT_STATS names (appended; xdist workers share it), with the library's
name, whether the object cache had it, LLVM's seconds (link, optimise, codegen) and the size of its IR text.
benchmarks/suite_time.py --jit sums them: what share of the suite's CPU time is LLVM's."""

from __future__ import annotations

import json
import os


def pytest_configure(config):
    path = os.environ.get("CFLOW_JIT_STATS")
    if not path:
        return
    from cflow.codegen.library import Library

    finalize = Library.finalize
    if getattr(finalize, "_jit_stats", False):
        return

    def recorded(self):
        was = self.finalized
        finalize(self)
        if was:
            return
        s = self.stats
        rec = {"name": self.name, "hit": s.get("cache_hit"), "llvm_s": s.get("total_s"),
               "ir_bytes": len(self.get_source_str()), "test": os.environ.get("PYTEST_CURRENT_TEST", "")}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    recorded._jit_stats = True
    Library.finalize = recorded
