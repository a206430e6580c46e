"""A hostile ONNX file's outcome is determined by the file, not by what the process imported before (issue 14).

docs/reliability.md ("Hostile files at scale", the caveat) records that with an older importer a fuzz case's outcome
depended on the process's history. One suspect was the importer's node indexes keyed by `id()` of protobuf
wrappers: protobuf hands out a fresh Python wrapper for a repeated-field element on each access and CPython reuses
the id of a freed one, so such an index is only sound while every wrapper it was built from stays alive. The
importer now keys nodes by its own `Node` objects (position `k` in graph.node; hashed by identity and kept alive by
the OnnxModel that owns them). Here: the fuzz harness's ONNX cases (benchmarks/fuzz.py, case i of seed s is
determined by (s, i)) imported in order, then again in a shuffled order in the same process, give
identical outcomes: the same one-line error, or the same imported graph printout."""

import importlib.util
import random
from pathlib import Path

import pytest
from onnx import helper

from cflow.errors import CflowError
from cflow.frontend import from_onnx
from cflow.frontend.onnx_graph import Node, OnnxModel
from cflow.ir.printer import format_graph
from tests._shared import arch24_tiny_onnx

FUZZ = Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz.py"
SEED, N = 14, 120  # ONNX-only numbering, as `fuzz.py --targets onnx --seed 14` (the long check: main below)


def _fuzz():
    spec = importlib.util.spec_from_file_location("cflow_fuzz_harness", FUZZ)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def case_files(tmp_path_factory) -> list[Path]:
    """Cases 0..N-1 of SEED with the ONNX base alone (so every case is an ONNX case), one file each."""
    fuzz = _fuzz()
    out = tmp_path_factory.mktemp("onnx_det")
    base = arch24_tiny_onnx().read_bytes()  # fuzz.build_bases's ONNX base: the preset's export, shared in the run
    blobs, muts = {"arch2_4_combined-tiny-onnx": ("onnx", base)}, fuzz.Mutators(None)
    files = []
    for i in range(N):
        case, blob = fuzz.case_for(SEED, i, blobs, muts)
        assert case["target"] == "onnx"
        p = out / f"case_{i}.onnx"
        p.write_bytes(blob)
        files.append(p)
    return files


def outcome(path: Path) -> str:
    try:
        g = from_onnx(path)
    except CflowError as e:
        return f"refused: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 -- any other exception is a bug; recorded so the comparison names it
        return f"BUG: {type(e).__name__}: {e}"
    return "imported:\n" + format_graph(g)


def test_outcomes_do_not_depend_on_import_order(case_files):
    first = {p.name: outcome(p) for p in case_files}
    bugs = {k: v for k, v in first.items() if v.startswith("BUG")}
    assert not bugs, bugs
    kinds = {v.split(":")[0] for v in first.values()}
    assert kinds == {"refused", "imported"}, kinds  # the cases exercise both ends of the importer
    shuffled = list(case_files)
    random.Random(1).shuffle(shuffled)
    again = {p.name: outcome(p) for p in shuffled}
    differ = [k for k in first if again[k] != first[k]]
    assert not differ, f"{len(differ)} cases changed outcome with the import order, e.g. {differ[0]}: " \
                       f"{first[differ[0]][:300]!r} then {again[differ[0]][:300]!r}"


def test_nodes_are_keyed_by_position_not_wrapper_identity():
    """Transient protobuf wrappers share ids (the hazard); the importer's Node index does not use them."""
    nodes = [helper.make_node("Identity", [f"v{i}"], [f"v{i + 1}"], name=f"n{i}") for i in range(6)]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("v0", 1, [1])],
                          [helper.make_tensor_value_info("v6", 1, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    om = OnnxModel(m, None, "<test>")
    assert all(isinstance(n, Node) for n in om.nodes)
    assert [om.order(n) for n in om.nodes] == list(range(6))
    assert [om.order(om.producer[f"v{i + 1}"]) for i in range(6)] == list(range(6))
    assert [n.name for n in om.backward_slice(["v6"], {"v0"})] == [f"n{i}" for i in range(6)]
    assert len({n for n in om.nodes}) == 6 and len({om.producer[f"v{i + 1}"] for i in range(6)}) == 6


def main(argv=None) -> int:
    """The long check (not in the suite): the ONNX cases among cases 0..N-1 of a seed, with the run's all-target
    numbering (vflow and GGUF cases skipped), imported in order and then shuffled in one process."""
    import argparse
    import hashlib
    import json
    import tempfile

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--cases", type=int, default=20000)
    args = ap.parse_args(argv)
    fuzz, tmp = _fuzz(), Path(tempfile.mkdtemp(prefix="cflow-onnx-det-"))
    base = fuzz.build_bases((), str(tmp), ("onnx",))["arch2_4_combined-tiny-onnx"][1]
    # Placeholder vflow/GGUF bases give case_for the run's target draw; only ONNX cases are built.
    blobs = {"vflow": ("vflow", b""), "gguf": ("gguf", b""), "arch2_4_combined-tiny-onnx": ("onnx", base)}
    targets = sorted({t for t, _ in blobs.values()})
    weights = [fuzz.TARGET_WEIGHTS[t] for t in targets]
    ids = [i for i in range(args.cases)
           if random.Random(f"{args.seed}:{i}").choices(targets, weights=weights)[0] == "onnx"]
    p = tmp / "case.onnx"

    def one(i: int) -> str:
        p.write_bytes(fuzz.case_for(args.seed, i, blobs, fuzz.Mutators(None))[1])
        r = outcome(p)
        return r if not r.startswith("imported") else "imported " + hashlib.sha256(r.encode()).hexdigest()[:16]

    first = {i: one(i) for i in ids}
    order = list(ids)
    random.Random(1).shuffle(order)
    again = {i: one(i) for i in order}
    kinds: dict = {}
    for v in first.values():
        kinds[v.split(":")[0].split(" ")[0]] = kinds.get(v.split(":")[0].split(" ")[0], 0) + 1
    differ = [i for i in ids if first[i] != again[i]]
    print(json.dumps(dict(seed=args.seed, cases=args.cases, onnx=len(ids), base_bytes=len(base), outcomes=kinds,
                          differ=differ[:20], n_differ=len(differ))))
    return 1 if differ or kinds.get("BUG") else 0


if __name__ == "__main__":
    raise SystemExit(main())


EXPORT = r"""
import hashlib, sys
sys.path.insert(0, sys.argv[1])
import cflow
assert cflow.__file__.startswith(sys.argv[1]), cflow.__file__
from cflow.frontend.export import export_onnx, load_torch_model
export_onnx(load_torch_model("preset:arch2_4_combined@tiny"), sys.argv[2])
print(hashlib.sha256(open(sys.argv[2], "rb").read()).hexdigest())
"""


def test_the_fuzz_base_export_does_not_depend_on_the_checkout_path(tmp_path):
    """torch.onnx writes each node's Python stack trace (absolute source paths) into the export; export_onnx drops
    them, so the fuzz harness's ONNX base, and with it case i of seed s, is the same bytes from any checkout."""
    import hashlib
    import shutil
    import subprocess
    import sys

    # this checkout (in this run's process that exported it first: tests/_shared.py), and a copy at a longer path in
    # another process
    src = Path(__file__).resolve().parents[2] / "cflow"
    here = arch24_tiny_onnx().read_bytes()
    digests = [hashlib.sha256(here).hexdigest()]
    root = tmp_path / "some/much/longer/checkout/path"
    shutil.copytree(src, root / "cflow", ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-c", EXPORT, str(root), str(tmp_path / "1.onnx")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    digests.append(out.stdout.split()[-1])
    assert digests[0] == digests[1]
    assert str(src.parent).encode() not in here
    assert str(tmp_path).encode() not in (tmp_path / "1.onnx").read_bytes()
