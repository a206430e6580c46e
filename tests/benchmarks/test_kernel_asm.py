"""benchmarks.kernel_asm finds the inner loops in the JIT's assembly and counts their instructions."""

from benchmarks import kernel_asm


def test_counts_the_loop_bodies(capsys):
    rows = {r["kernel"]: r for r in kernel_asm.main(["--cols", "512", "--knobs", "unroll=1"])}
    assert set(rows) == {"q4", "q8", "read loop"}
    # the read loop: 8 x 64-byte loads folded into xors (16 or 32 on 256/128-bit hosts) + counter, compare, branch
    assert 8 <= rows["read loop"]["instructions"] <= 40
    assert min(rows["q4"]["per_line"], rows["q8"]["per_line"]) > rows["read loop"]["per_line"]
    assert "per 64-byte line" in capsys.readouterr().out


def test_loop_body_picks_the_block_that_jumps_back():
    asm = """f:
\tmovq %rdi, %rax
.LBB0_2:
\tvpxorq (%rdi), %zmm0, %zmm0
\taddq $64, %rdi
\tjl .LBB0_2
\tvpxorq %zmm1, %zmm0, %zmm0
\tvpxorq %zmm2, %zmm0, %zmm0
\tvpxorq %zmm3, %zmm0, %zmm0
\tretq
"""
    assert kernel_asm.loop_body(asm) == ["vpxorq", "addq", "jl"]


def test_counts_a_block_type_with_its_built_in_loop_kind():
    """--types takes GGUF and cflow's own block types (a 192-input type in 192-column tiles); each kernel is built
    with its built-in knobs on this path (tune.default_for) and the row says which."""
    rows = {r["kernel"]: r for r in kernel_asm.main(["--cols", "512", "--types", "Q4_K,IQ4_192"])}
    assert set(rows) == {"Q4_K", "IQ4_192", "read loop"}
    assert all(rows[k]["instructions"] > rows["read loop"]["instructions"] for k in ("Q4_K", "IQ4_192"))
    assert rows["Q4_K"]["knobs"].startswith(("u", "gloop"))


def test_counts_another_version_of_the_decoder(tmp_path):
    """--blockdot builds the block types' kernels from another blockdot.py (here without Q3_K's integer combine:
    another count) and leaves the tree's decoder in place after."""
    from cflow.codegen import blockdot
    from cflow.codegen import kernels as K
    from tests.benchmarks._blockdot_versions import without_q3k_combine

    other = without_q3k_combine(tmp_path / "bd.py")
    base = kernel_asm.main(["--cols", "512", "--types", "Q3_K"])[0]
    alt = kernel_asm.main(["--cols", "512", "--types", "Q3_K", "--blockdot", str(other)])[0]
    assert base["kernel"] == alt["kernel"] == "Q3_K" and base["instructions"] != alt["instructions"]
    assert K.blockdot is blockdot


def test_counts_the_matmat_loops(capsys):
    """--matmat counts the multi-token kernel's inner loop: one unit of a pass's row groups for each token of the
    path's token group (kernels.matmat_groups), per 64-byte line and token."""
    from cflow.codegen import kernels as K
    from cflow.codegen.target import host_target
    from cflow.layout.tile import TileLayout

    rows = {r["kernel"]: r for r in kernel_asm.main(["--cols", "512", "--types", "q4,Q4_K", "--matmat"])}
    assert set(rows) == {"q4", "Q4_K", "read loop"}
    isa = host_target().isa
    for name, dt in (("q4", "q4"), ("Q4_K", "q4_k")):
        L = TileLayout(dt, 128, 512, (128, 256))
        tg, gp = K.matmat_groups(L, isa)
        assert rows[name]["knobs"] == f"tokens={tg},row_groups={gp}"
        assert rows[name]["lines"] == gp / L.groups_per_tile * L.unit_nbytes / 64 * tg
    assert "per 64-byte line and token" in capsys.readouterr().out
