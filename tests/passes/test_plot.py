"""passes.plot: the stage timeline `cflow inspect --plot` draws from a compiled file's header."""

import pytest

from cflow.compiler import compile_file
from cflow.errors import CflowError
from cflow.frontend.load import load_graph
from cflow.passes.plot import plot_schedule
from cflow.runtime.format import FileReader

pytest.importorskip("matplotlib")


def test_plot_from_compiled_header(tmp_path):
    compile_file(load_graph("preset:arch2_4_combined@tiny"), tmp_path / "m.vflow")
    with FileReader(tmp_path / "m.vflow") as r:
        header = r.header
    plot_schedule(header, str(tmp_path / "stages.png"))
    assert (tmp_path / "stages.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(CflowError, match="does not exist"):
        plot_schedule(header, str(tmp_path / "no" / "stages.png"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.vflow", "stages.png"]


def test_plot_of_a_stored_file(tmp_path):
    """A file whose weights keep their own types (a GGUF's, a type mix's): the critical path from the header's
    weight_dtypes (the graph rebuilt from the config has none)."""
    from cflow.passes.mix import auto_mix

    g, _ = auto_mix(load_graph("preset:arch2_4_combined@tiny"), budget=5.0)
    compile_file(g, tmp_path / "m.vflow", "stored")
    with FileReader(tmp_path / "m.vflow") as r:
        header = r.header
    assert header["quant"] == "stored"
    plot_schedule(header, str(tmp_path / "stages.png"))
    assert (tmp_path / "stages.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
