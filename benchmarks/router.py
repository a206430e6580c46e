"""The MoE gate alone (codegen.ops.router: logits, softmax, top-k) in microseconds per call.

    python -m benchmarks.router [--d 2048] [--experts 8] [--top-k 2] [--calls 20000] [--json [FILE]]

Every thread runs the router itself before its experts' mat-vecs (codegen/moe.py), once per MoE layer and
token, so its time is added to every MoE layer of every token whatever the thread count. The call goes through
ctypes (~0.3 us of each figure).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
from llvmlite import ir

from benchmarks.common.record import Run, add_json_argument
from cflow.codegen import ops as O
from cflow.codegen.library import Library
from cflow.codegen.target import cpu_model, host_target


def router_fn(d: int, experts: int, top_k: int, normalize: bool = False):
    """ops.router JIT-compiled alone: f(x, w, probs, route) through ctypes (the library is kept on the function)."""
    m = ir.Module(name="router_bench")
    fn = O.router(m, d, experts, top_k, normalize)
    fn.linkage = "external"
    lib = Library(name="router_bench", target=host_target(), cache=None)
    lib.add_ir(m)
    lib.finalize()
    vp = ctypes.c_void_p
    f = lib.get_cfunc(fn.name, None, vp, vp, vp, vp)
    f.library = lib  # the code lives as long as the library
    return f


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=2048, help="input width (d_model)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20000)
    add_json_argument(ap, "write the record")
    args = ap.parse_args(argv)
    run = Run("router", argv)
    f = router_fn(args.d, args.experts, args.top_k)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(args.d).astype(np.float32)
    w = rng.standard_normal((args.experts, args.d)).astype(np.float32)
    probs = np.zeros(args.experts, np.float32)
    route = np.zeros(8 * args.top_k, np.uint8)
    a = [x.ctypes.data, w.ctypes.data, probs.ctypes.data, route.ctypes.data]
    for _ in range(100):
        f(*a)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            f(*a)
        best = min(best, (time.perf_counter() - t0) / args.calls)
    print(f"# {cpu_model()}; router d={args.d} experts={args.experts} top-k={args.top_k}: "
          f"{best * 1e6:.2f} us per call (best of 3 x {args.calls} calls)")
    run.write(args.json, [run.record(engine="router", model=f"d {args.d}, {args.experts} experts, top {args.top_k}",
                                     threads=1, us_per_call=best * 1e6, calls=args.calls)])
    return best


if __name__ == "__main__":
    main()
