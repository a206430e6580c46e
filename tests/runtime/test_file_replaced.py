"""Recompiling a model file while a process has it loaded is safe: `cflowc -o` (compile_file) writes a temporary
file and renames it over the old one, so the running model keeps the old inode, mapped and intact, and decodes on
bit-identically; the next load sees the new file. (Truncating or rewriting the loaded file *in place* is not safe:
RAM mode maps it, and a page past the new end is a SIGBUS, as with every mmap-based runtime: docs/reliability.md,
Limits.)"""

import os

import numpy as np

import cflow
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph


def test_recompiling_over_a_loaded_file_leaves_it_running(tmp_path):
    path = tmp_path / "m.vflow"
    compile_file(load_graph("preset:arch1@tiny"), path, "q4")
    ids = [1, 2, 3, 4]
    with cflow.load(path, threads=1) as m:
        before = m.logits(ids).copy()
        ino = os.stat(path).st_ino
        compile_file(load_graph("preset:arch2_4_combined@tiny"), path, "q8")  # another model, same path
        assert os.stat(path).st_ino != ino  # a new file was renamed into place
        np.testing.assert_array_equal(m.logits(ids), before)  # the loaded one is untouched
    with cflow.load(path, threads=1) as m2:
        assert m2.ir.name == "arch2_4_combined" and m2.session.header["quant"] == "q8"
