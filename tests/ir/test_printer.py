"""The printed IR is part of the product: arch2_4_combined@tiny is pinned as a golden file."""

from pathlib import Path

from cflow.ir import build_graph
from cflow.models import get_preset

GOLDEN = Path(__file__).parent.parent / "golden" / "arch2_4_combined_tiny.ir"


def test_golden_ir():
    # To update after an intended change:
    #   cflowc preset:arch2_4_combined@tiny --emit ir > tests/golden/arch2_4_combined_tiny.ir
    assert str(build_graph(get_preset("arch2_4_combined", "tiny"))) == GOLDEN.read_text()


def test_print_is_stable_across_builds():
    c = get_preset("arch5_shared", "tiny")
    assert str(build_graph(c)) == str(build_graph(c))


def test_one_line_per_node():
    gr = build_graph(get_preset("arch1", "tiny"))
    lines = str(gr).splitlines()
    assert lines[0].startswith("graph arch1(") and lines[-1] == "  return %logits"
    assert len(lines) == len(gr) + 2
