"""L1-d read misses of the tile layout against row-major Q4 on the same matrix, counted by cachegrind.

    python -m benchmarks.claims_cachegrind [--shape 2048x2048] [--reps 4] [--json [FILE]]

The paper claims that its tile layout takes 7.29x fewer L1-d read misses than a row-major kernel. Three kernels
multiply the same Q4 matrix (GGUF Q4_0 codes and fp16 scales) by the same int8 activation:

  tile     cflow's mat-vec (codegen/kernels.py::emit_matvec, prefetch off) on the tile stream (layout/tile.py).
  rows16   the same kernel on GGUF's row-major Q4_0 array (row r, block k at (r * K/32 + k) * 18 bytes: fp16
           scale, 16 code bytes): for each block, the 128 rows' 18 bytes are gathered from 128 rows into an
           L1-resident unit buffer laid out as a tile unit, then the tile kernel's own unit code
           (kernels._q_unit) runs on it. Same arithmetic, same loop order: only where the bytes come from differs.
  row1     a row at a time, as ggml's vec_dot_q4_0_q8_0 walks a row-major matrix: per block, unpack 32 nibbles,
           one integer dot with the activation block, the same fma per block as the tile kernel's lanes.

All three give bit-identical outputs (checked here, natively, before anything is counted), so the comparison is
of memory access patterns alone. cachegrind is deterministic, but valgrind 3.19 has no AVX-512 decoder, so the
kernels are compiled for haswell (AVX2 + FMA + F16C: the kernels' avx2 family); the access pattern is the
ISA's only through the load width (32-byte halves of the 64-byte loads the AVX-512 kernel makes).

The kernels are compiled ahead of time (llvmlite, the library's optimisation pipeline) into an object file and
linked into a small C driver, so valgrind runs no Python and no JIT; the driver calls one kernel --reps times
over the whole matrix, and the kernel's own counts are read per function from the cachegrind output (the
driver's reads of the input files are not in them). The simulated caches are set explicitly to the host's
L1-d (32 KiB, 8-way, 64-byte lines; --D1) and last level (--LL), so the numbers do not depend on what
cachegrind guesses about the CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import numpy as np
from llvmlite import ir

from benchmarks.common.record import Run, add_json_argument
from cflow.codegen import kernels as K
from cflow.codegen.cgutils import Loop, V, c64, f32, half_to_float, i8, i16, i32, intrinsic, new_function, ptr
from cflow.codegen.library import Library
from cflow.codegen.target import ISA as KernelISA
from cflow.codegen.target import host_target, init_llvm
from cflow.layout.quant import BLOCK, DType, quantize, quantize_activation_q8
from cflow.layout.tile import TileLayout, pack

ISA = KernelISA.AVX2  # the kernels' unit code takes the enum (its .vnni), not the name
CPU = "haswell"  # no AVX-512: valgrind 3.19 cannot decode it
GGUF_BLOCK = 18  # Q4_0: fp16 scale + 16 code bytes per 32 weights
KERNELS = ("tile", "rows16", "row1")


# --- the row-major kernels ------------------------------------------------------------------------------------
def emit_rows16(mod: ir.Module, name: str, L: TileLayout) -> ir.Function:
    """Row-major Q4_0 through the tile kernel's own unit code (see the module docstring)."""
    fn = new_function(mod, name, K.MATVEC_ARGS, "external", ("w", "x", "xq", "xd", "xs", "y", "r0", "r1"))
    w, _x, xq, xd, xs, y, r0, r1 = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    ng, nb, row_bytes = L.groups_per_tile, L.cols // BLOCK, (L.cols // BLOCK) * GGUF_BLOCK
    slots = [b.alloca(V(f32, 16), name=f"acc{g}") for g in range(ng)]
    unit_buf = b.alloca(ir.ArrayType(i8, L.unit_nbytes), name="unit")
    unit_buf.align = 64
    unit = b.bitcast(unit_buf, ir.PointerType(i8))
    zf = ir.Constant(V(f32, 16), [0.0] * 16)
    with Loop(b, r0, r1, "t") as t:
        for s in slots:
            b.store(zf, s)
        row0 = ptr(b, w, b.mul(t, c64(L.tr * row_bytes)))
        with Loop(b, c64(0), c64(nb), "kb") as kb:
            blk = ptr(b, row0, b.mul(kb, c64(GGUF_BLOCK)))
            for g in range(ng):  # gather the unit: every row's scale and 4-byte code chunks into tile positions
                for i in range(16):
                    src = ptr(b, blk, (16 * g + i) * row_bytes)
                    b.store(b.load(ptr(b, src, 0, i16), align=1), ptr(b, unit, L.scales_offset + 32 * g + 2 * i, i16),
                            align=2)
                    for c in range(4):
                        v = b.load(ptr(b, src, 2 + 4 * c, i32), align=1)
                        b.store(v, ptr(b, unit, g * L.code_nbytes + 64 * c + 4 * i, i32), align=4)
            accs = {g: b.load(slots[g]) for g in range(ng)}
            K._q_unit(b, L, ISA, unit, kb, list(range(ng)), accs, xq, xd, xs)
            for g in range(ng):
                b.store(accs[g], slots[g])
        yv = ptr(b, y, b.mul(t, c64(L.tr)), V(f32, 16))
        for g in range(ng):
            b.store(b.load(slots[g]), ptr(b, yv, g), align=4)
    b.ret_void()
    return fn


def emit_row1(mod: ir.Module, name: str, L: TileLayout) -> ir.Function:
    """Row-major Q4_0, one row at a time (ggml's order); per block the tile kernel's integer dot and fma."""
    fn = new_function(mod, name, K.MATVEC_ARGS, "external", ("w", "x", "xq", "xd", "xs", "y", "r0", "r1"))
    w, _x, xq, xd, xs, y, r0, r1 = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    nb, row_bytes = L.cols // BLOCK, (L.cols // BLOCK) * GGUF_BLOCK
    acc = b.alloca(f32, name="acc")
    fma = intrinsic(mod, "llvm.fma.f32", f32, [f32, f32, f32])
    maddubs = intrinsic(mod, "llvm.x86.avx2.pmadd.ub.sw", V(i16, 16), [V(i8, 32), V(i8, 32)])
    maddwd = intrinsic(mod, "llvm.x86.avx2.pmadd.wd", V(i32, 8), [V(i16, 16), V(i16, 16)])
    radd = intrinsic(mod, "llvm.vector.reduce.add.v8i32", i32, [V(i32, 8)])
    ones = ir.Constant(V(i16, 16), [1] * 16)
    with Loop(b, b.mul(r0, c64(L.tr)), b.mul(r1, c64(L.tr)), "r") as r:
        b.store(ir.Constant(f32, 0.0), acc)
        row = ptr(b, w, b.mul(r, c64(row_bytes)))
        with Loop(b, c64(0), c64(nb), "kb") as kb:
            src = ptr(b, row, b.mul(kb, c64(GGUF_BLOCK)))
            dw = half_to_float(b, b.load(ptr(b, src, 0, i16), align=1), ISA)
            codes = b.load(ptr(b, src, 2, V(i8, 16)), align=1)  # byte j: input j (low nibble), j + 16 (high)
            lo = b.and_(codes, ir.Constant(V(i8, 16), [0x0F] * 16))
            hi = b.lshr(codes, ir.Constant(V(i8, 16), [4] * 16))
            q = b.shuffle_vector(lo, hi, ir.Constant(V(i32, 32), list(range(32))))
            a = b.load(ptr(b, xq, b.mul(kb, c64(BLOCK)), V(i8, 32)), align=1)
            isum = b.call(radd, [b.call(maddwd, [b.call(maddubs, [q, a]), ones])])  # exact: |pair| <= 3840
            isum = b.sub(isum, b.mul(b.load(ptr(b, xs, kb)), ir.Constant(i32, 8)))  # codes are q + 8
            scale = b.fmul(dw, b.load(ptr(b, xd, kb)))
            b.store(b.call(fma, [b.sitofp(isum, f32), scale, b.load(acc)]), acc)
        b.store(b.load(acc), ptr(b, y, r))
    b.ret_void()
    return fn


DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef void mv_t(const void*, const float*, const void*, const void*, const void*, float*, int64_t, int64_t);
mv_t tile_mv, rows16_mv, row1_mv;
static void* slurp(const char* dir, const char* name) {
    char p[4096]; snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE* f = fopen(p, "rb"); if (!f) { perror(p); exit(2); }
    fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
    void* buf = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (fread(buf, 1, n, f) != (size_t)n) { perror(p); exit(2); }
    fclose(f); return buf;
}
int main(int argc, char** argv) {  /* driver DIR KERNEL REPS TILE_ROWS ROWS */
    if (argc != 6) return 2;
    const char* dir = argv[1]; const char* k = argv[2]; int reps = atoi(argv[3]);
    int64_t tile_rows = atol(argv[4]), rows = atol(argv[5]);
    mv_t* f = !strcmp(k, "tile") ? tile_mv : !strcmp(k, "rows16") ? rows16_mv : !strcmp(k, "row1") ? row1_mv : 0;
    if (!f) return 2;
    void* w = slurp(dir, !strcmp(k, "tile") ? "w_tile.bin" : "w_row.bin");
    void* xq = slurp(dir, "xq.bin"); void* xd = slurp(dir, "xd.bin"); void* xs = slurp(dir, "xs.bin");
    float* y = aligned_alloc(64, rows * sizeof(float));
    for (int r = 0; r < reps; r++) f(w, 0, xq, xd, xs, y, 0, tile_rows);
    char p[4096]; snprintf(p, sizeof p, "%s/y_%s.bin", dir, k);
    FILE* o = fopen(p, "wb"); fwrite(y, sizeof(float), rows, o); fclose(o);
    return 0;
}
"""


def build(d: str, L: TileLayout) -> str:
    """Emit the three kernels, compile them for haswell into an object, link the driver; returns its path."""
    import llvmlite.binding as llvm

    init_llvm()
    mod = ir.Module(name="claims_cachegrind")
    K.emit_matvec(mod, "tile_mv", L, ISA, prefetch=0)  # prefetches would be no-ops to cachegrind anyway
    emit_rows16(mod, "rows16_mv", L)
    emit_row1(mod, "row1_mv", L)
    target = host_target(cpu=CPU, env=False)
    lib = Library(name="claims_cachegrind", target=target, cache=False)
    lib.add_ir(mod)
    optimised = lib.get_llvm_str()  # the library's own pipeline, as the JIT would run it
    tm = llvm.Target.from_triple(target.triple).create_target_machine(cpu=target.cpu, features=target.features,
                                                                       opt=3, reloc="pic")
    m = llvm.parse_assembly(optimised)
    m.triple, m.data_layout = target.triple, str(tm.target_data)
    obj = os.path.join(d, "kernels.o")
    with open(obj, "wb") as f:
        f.write(tm.emit_object(m))
    src = os.path.join(d, "driver.c")
    with open(src, "w") as f:
        f.write(DRIVER)
    exe = os.path.join(d, "driver")
    subprocess.run(["cc", "-O1", "-g", src, obj, "-o", exe], check=True)
    return exe


def write_inputs(d: str, L: TileLayout, seed: int = 0) -> np.ndarray:
    """The same Q4 matrix as a tile stream and as GGUF's row-major Q4_0; one int8 activation. Returns the
    NumPy oracle's y."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((L.rows, L.cols)).astype(np.float32) * 0.05
    t = quantize(w, "q4")
    pack(t, "q4", L.tile).tofile(os.path.join(d, "w_tile.bin"))
    q = t.q.astype(np.uint8)  # [rows, nblk, 32], 0..15
    row = np.empty((L.rows, L.cols // BLOCK, GGUF_BLOCK), np.uint8)
    row[..., :2] = t.scales.astype(np.float16).view(np.uint8).reshape(L.rows, -1, 2)
    row[..., 2:] = q[..., :16] | (q[..., 16:] << 4)
    row.tofile(os.path.join(d, "w_row.bin"))
    x = rng.standard_normal(L.cols).astype(np.float32)
    aq, ad = quantize_activation_q8(x)
    aq.astype(np.int8).tofile(os.path.join(d, "xq.bin"))
    ad.astype(np.float32).tofile(os.path.join(d, "xd.bin"))
    aq.astype(np.int32).reshape(-1, BLOCK).sum(-1).astype(np.int32).tofile(os.path.join(d, "xs.bin"))
    return (((t.q.astype(np.int64) - 8) * aq.reshape(-1, BLOCK)[None].astype(np.int64)).sum(-1)
            * t.scales.astype(np.float64) * ad).sum(-1)


EVENTS_RE = re.compile(r"^events:\s*(.*)$")


def per_function(out_file: str) -> dict[str, dict[str, int]]:
    """Sum the cachegrind counts of every function (handles the (id) name compression)."""
    names: dict[str, str] = {}
    events: list[str] = []
    totals: dict[str, dict[str, int]] = {}
    fn = None
    with open(out_file) as f:
        for line in f:
            m = EVENTS_RE.match(line)
            if m:
                events = m.group(1).split()
                continue
            if line.startswith("fn="):
                v = line[3:].strip()
                mm = re.match(r"\((\d+)\)\s*(.*)", v)
                if mm:
                    if mm.group(2):
                        names[mm.group(1)] = mm.group(2)
                    v = names[mm.group(1)]
                fn = v
                totals.setdefault(fn, dict.fromkeys(events, 0))
                continue
            if fn and line[:1].isdigit():
                vals = line.split()[1:]
                for e, v in zip(events, vals):
                    totals[fn][e] += int(v)
    return totals


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2048x2048", help="rows x cols of the matrix (TinyLlama's O projection)")
    ap.add_argument("--reps", type=int, default=4, help="mat-vecs per kernel under cachegrind")
    ap.add_argument("--D1", default="32768,8,64", help="simulated L1-d: size,assoc,line (the host's)")
    ap.add_argument("--LL", default="33554432,16,64", help="simulated last level: size,assoc,line (the host's L3)")
    add_json_argument(ap, "write one record per kernel (no timing: tok_s is null)")
    args = ap.parse_args(argv)
    run = Run("claims_cachegrind", argv)
    rows, cols = (int(v) for v in args.shape.lower().split("x"))
    L = TileLayout(DType.Q4, rows, cols)
    if rows % L.tr or cols % L.tile[1]:
        raise SystemExit(f"--shape: rows must be a multiple of {L.tr} and cols of {L.tile[1]} (no padding here)")
    with tempfile.TemporaryDirectory(prefix="cflow-cachegrind-") as d:
        ref = write_inputs(d, L)
        exe = build(d, L)
        ys = {}
        for k in KERNELS:  # natively first: the three must agree bit for bit
            subprocess.run([exe, d, k, "1", str(L.n_tile_rows), str(rows)], check=True)
            ys[k] = np.fromfile(os.path.join(d, f"y_{k}.bin"), np.float32)
        for k in KERNELS[1:]:
            if ys[k].tobytes() != ys["tile"].tobytes():
                raise SystemExit(f"{k}: output differs from the tile kernel's (max |diff| "
                                 f"{np.abs(ys[k] - ys['tile']).max():.3g})")
        rel = float(np.abs(ys["tile"] - ref).max() / np.abs(ref).max())
        print(f"# {rows}x{cols} Q4 ({L.nbytes / 1e6:.2f} MB tile stream), kernels for {CPU} ({ISA}); "
              f"the three outputs are bit-identical; max rel err vs the NumPy oracle {rel:.1e}")
        res = {}
        for k in KERNELS:
            out = os.path.join(d, f"cg_{k}.out")
            cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--D1={args.D1}", f"--LL={args.LL}",
                   f"--I1={args.D1}", f"--cachegrind-out-file={out}", exe, d, k, str(args.reps),
                   str(L.n_tile_rows), str(rows)]
            subprocess.run(cmd, check=True, capture_output=True)
            fns = per_function(out)
            c = fns[f"{k}_mv"]
            res[k] = {e: c[e] / args.reps for e in ("Ir", "Dr", "D1mr", "DLmr")}
            res[k]["weight_bytes"] = os.path.getsize(os.path.join(d, "w_tile.bin" if k == "tile" else "w_row.bin"))
            print(f"{k:7} per mat-vec: D1 read misses {res[k]['D1mr']:10.0f}  data reads {res[k]['Dr']:10.0f}  "
                  f"instructions {res[k]['Ir']:10.0f}  (weights {res[k]['weight_bytes'] / 64:.0f} lines of 64 B)")
    ratios = {k: res[k]["D1mr"] / res["tile"]["D1mr"] for k in KERNELS[1:]}
    for k, r in ratios.items():
        print(f"{k} / tile D1 read misses: {r:.2f}x")
    records = [run.record(engine="q4 mat-vec", model=f"{rows}x{cols}", quant="q4", isa_path=ISA, threads=1,
                          variant=k, per_matvec=res[k], d1mr_ratio_vs_tile=ratios.get(k, 1.0)) for k in KERNELS]
    if args.json is not None:
        valgrind = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
        run.write(args.json, records, {"shape": [rows, cols], "cpu_for_kernels": CPU, "reps": args.reps,
                                       "D1": args.D1, "LL": args.LL, "valgrind": valgrind})


if __name__ == "__main__":
    main()
