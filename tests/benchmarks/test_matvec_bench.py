"""benchmarks/matvec.py's oracle check runs (it broke once on a MatVec it built by hand, without the `planes` field
the constructor sets; it now takes the constructor)."""

from benchmarks import matvec as B
from cflow.codegen.library import Library
from cflow.codegen.target import host_target


def test_the_oracle_check_runs_and_agrees():
    target = host_target()
    mats, one, _ = B.make_weights((128, 256), layers=1)
    lib = Library(name="test_matvec_bench", target=target, cache=False)
    assert B.check(lib, (128, 256), mats, one, target.isa) < 1e-5
