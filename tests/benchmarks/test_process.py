"""benchmarks/common/process.py: children with another cflow tree."""


def test_a_baseline_tree_gives_its_cflow_and_this_trees_benchmarks(tmp_path):
    """child_env(tree): the tree's cflow package alone first on the child's path, so that a whole checkout given as
    the tree does not put its own (older) benchmarks in front of this repository's."""
    import subprocess
    import sys

    from benchmarks.common.process import child_env

    tree = tmp_path / "old"
    (tree / "cflow").mkdir(parents=True)
    (tree / "cflow" / "__init__.py").write_text("OLD = True\n")
    (tree / "benchmarks").mkdir()
    (tree / "benchmarks" / "__init__.py").write_text("raise ImportError('the old tree's benchmarks')\n")
    code = "import cflow, benchmarks.common; print(getattr(cflow, 'OLD', False))"
    out = subprocess.run([sys.executable, "-c", code], env=child_env(str(tree)), capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
