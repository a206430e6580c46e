"""benchmarks/suite_time.py: the README's test command timed per ISA path and load."""

from benchmarks.suite_time import main, path_env, run_suite


def test_each_path_is_forced_as_users_force_it(monkeypatch):
    monkeypatch.setenv("CFLOW_FEATURES", "-avx512f")  # a caller's own setting does not leak into the runs
    assert "CFLOW_FEATURES" not in path_env("own") and "CFLOW_CPU" not in path_env("own")
    assert path_env("avx2")["CFLOW_FEATURES"] == "-avx512f,-avxvnni,-gfni"
    assert path_env("generic")["CFLOW_CPU"] == "generic"


def test_a_run_reports_time_cpu_and_the_summary():
    r = run_suite("own", "none", ["-n", "0", "tests/test_util.py"])
    assert r["returncode"] == 0 and "passed" in r["summary"]
    assert r["wall_s"] > 0 and r["user_s"] > 0 and 0 <= r["other_load"] <= 1


def test_unknown_paths_are_refused(capsys):
    import pytest

    with pytest.raises(SystemExit, match="unknown path"):
        main(["--paths", "own,avx3"])



def test_jit_records_the_libraries_the_tests_compile():
    r = run_suite("own", "none", ["-n", "0", "tests/codegen/test_kernels.py", "-k", "emitted_once and q4 and mv"],
                  jit=True)
    assert r["returncode"] == 0 and r["jit_compiled"] >= 1 and r["jit_llvm_s"] > 0 and r["jit_ir_mb"] > 0
