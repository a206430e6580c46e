"""What drawing a token costs: the Sampler's plain-temperature draw, native (codegen/draw.py) against its NumPy
path, per call and in the bundled model's decode loop, measured in one run.

    python -m benchmarks.sampling [--vocab 2048,32000,151936] [--tokens 192] [--rounds 5] [--json [FILE]]

Per vocabulary size: the time of one draw by `Sampler.draw` as it is and as it was, best of 3 repeats: plain
temperature 0.8 (now one native call; before, `Sampler._support` then `sampling._pick`: the weights, the block
sums and the inverse CDF as NumPy calls), and top-p 0.95 over a flat and a peaked row (now the native weights and
a nucleus found among the candidates above its floor, gathered once; before, NumPy's weights and every probe over
the whole vocabulary: `_nucleus(gather=False)`). The bundled model (2,048 tokens): `m.generate` of --tokens
tokens at temperature 0.8 with either draw, and greedy, in --rounds interleaved rounds (medians): the tok/s a user
of `cflow run` sees.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import numpy as np

from benchmarks.common.record import Run, add_json_argument


def numpy_draw(s, x, u):
    """The Sampler's draw without its native call: what it did before codegen/draw.py."""
    from cflow.runtime.sampling import _pick

    ids, w = s._support(x)
    i = _pick(w, u)
    return i if ids is None else int(ids[i])


def numpy_top_p_draw(s, x, u):
    """A top-p draw as the Sampler made it before: NumPy's weights, the nucleus probed over the whole vocabulary
    (sampling._nucleus(gather=False)), sampling._pick."""
    from cflow.runtime.sampling import _nucleus, _pick

    e = np.subtract(x, x.max(), dtype=np.float64)
    e /= s.temperature
    np.exp(e, out=e)
    ids = _nucleus(x, e, s.top_p, gather=False)
    return int(ids[_pick(e[ids], u)])


def rows(n: int) -> dict[str, np.ndarray]:
    """float32 logits of n tokens: "flat" (normal, std 3: a wide nucleus) and "peaked" (the same with ~40 tokens
    raised by 12, as a trained model's few likely tokens: a narrow one)."""
    rng = np.random.default_rng(n)
    flat = (rng.standard_normal(n) * 3).astype(np.float32)
    peaked = flat + np.float32(12) * (rng.random(n) < 40 / n).astype(np.float32)
    return {"flat": flat, "peaked": peaked}


def timed(fn, n: int) -> float:
    number = max(10, 200_000 // n)
    return min(timeit.repeat(fn, number=number, repeat=3)) / number


def per_call(n: int) -> list[tuple[str, float, float]]:
    """(what, native seconds, NumPy seconds) per draw over rows of n logits: plain temperature, and top-p 0.95 (the
    Sampler as it is against its path before the candidate gathering and native weights)."""
    from cflow.runtime.sampling import Sampler

    x = rows(n)
    plain = Sampler(0.8, seed=0)
    out = [("temperature 0.8", timed(lambda: plain.draw(x["flat"], 0.3), n),
            timed(lambda: numpy_draw(plain, x["flat"], 0.3), n))]
    top = Sampler(0.8, top_p=0.95, seed=0)
    for kind, r in x.items():
        out.append((f"top-p 0.95, {kind}", timed(lambda r=r: top.draw(r, 0.3), n),
                    timed(lambda r=r: numpy_top_p_draw(top, r, 0.3), n)))
    return out


def generate_loop(m, ids, tokens: int, how: str) -> float:
    """tok/s of m.generate: "native" or "numpy" draws at temperature 0.8, or "greedy"."""
    from cflow.runtime import sampling

    plain = sampling.Sampler._plain
    if how == "numpy":
        sampling.Sampler._plain = lambda self, x, u: numpy_draw(self, x, u)
    try:
        t = time.perf_counter()
        out = m.generate(ids, max_new_tokens=tokens, temperature=0.0 if how == "greedy" else 0.8, seed=1, stop=False)
        return len(out) / (time.perf_counter() - t)
    finally:
        sampling.Sampler._plain = plain


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sampling", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", default="2048,32000,151936", help="vocabulary sizes to time one draw over "
                   "(default 2048,32000,151936)")
    p.add_argument("--tokens", type=int, default=192, help="tokens per generate (default 192)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the decode loop (default 5)")
    add_json_argument(p)
    args = p.parse_args(argv)
    import cflow
    from benchmarks.conformance import cache_dir
    from benchmarks.speculate import model_file
    from cflow.codegen.target import isa_path

    run = Run("sampling", argv)
    print(f"# {run.cpu_model}, ISA path {isa_path()}", flush=True)
    records = []
    for n in (int(v) for v in args.vocab.split(",")):
        for what, native, slow in per_call(n):
            print(f"vocab {n:>7}, {what:<22}: now {native * 1e6:8.2f} us a draw, before (NumPy) "
                  f"{slow * 1e6:8.2f} us ({slow / native:.2f}x)", flush=True)
            records.append(run.record(engine="cflow", model=f"vocab {n}", variant=f"draw, {what}",
                                      native_us=native * 1e6, numpy_us=slow * 1e6, ratio=slow / native))
    work = cache_dir(None) / "speculate"
    work.mkdir(parents=True, exist_ok=True)
    m = cflow.load(model_file("bundled", cache_dir(None), work))  # compiled once (default quantisation)
    try:
        ids = m.tokenizer.encode("Once upon a time")
        tokens = min(args.tokens, m.session.max_seq - len(ids))
        got: dict[str, list[float]] = {"native": [], "numpy": [], "greedy": []}
        for _ in range(args.rounds):
            for how in got:
                got[how].append(generate_loop(m, ids, tokens, how))
        med = {k: statistics.median(v) for k, v in got.items()}
        print(f"bundled model, m.generate of {tokens} tokens, {m.session.threads} threads, medians of "
              f"{args.rounds}: temperature 0.8 native {med['native']:.0f} tok/s, NumPy {med['numpy']:.0f} tok/s "
              f"({med['native'] / med['numpy']:.2f}x), greedy {med['greedy']:.0f} tok/s", flush=True)
        for how, v in got.items():
            records.append(run.record(engine="cflow", model="bundled", quant=m.session.header.get("quant"),
                                      threads=m.session.threads, variant=f"generate {how}", tok_s=med[how],
                                      runs=v, tokens=tokens))
    finally:
        m.close()
    run.write(args.json, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
