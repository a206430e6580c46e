"""Why arch1 vs arch2_4_combined at 114m depends on the text: the experts each greedy token routes to, and how
much of a token's stream a last-level cache of a given size could hold (an LRU model, not a measurement).

    python -m benchmarks.claims_routes --tokens 128

The tokens are the compiled Q4 model's own greedy decode (the files benchmarks.claims_schedule times, same 4-token
prompt); the routes are the Q4 interpreter's, teacher-forced on those tokens. At 114m a token streams 28.4 MB,
less than a 32 MiB L3: a token whose experts are the previous token's is served largely from the cache, so a
preset whose random-weight text repeats itself decodes faster. The LRU model streams each token's weights in
64 KiB pieces (the non-expert weights, then the chosen experts layer by layer) through an LRU of --cache-mb.
"""

from __future__ import annotations

import argparse
import collections

import cflow
from benchmarks.claims_schedule import PROMPT, compiled
from benchmarks.common.record import Run, add_json_argument
from cflow.compiler import lower
from cflow.frontend.load import load_graph
from cflow.ir import Interpreter
from cflow.ir.nodes import Router

PIECE = 1 << 16


class RouteRecorder(Interpreter):
    """The interpreter, noting each router's choice for the last token it ran."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.chosen: dict[str, tuple[int, ...]] = {}

    def _exec(self, n, v):
        out = super()._exec(n, v)
        if isinstance(n, Router):
            self.chosen[n.name] = tuple(sorted(int(i) for i in out[1][-1]))
        return out


def routes_of(name: str, size: str, tokens: int):
    """(greedy tokens, per token {router: experts}, bytes of one expert, bytes streamed per token)."""
    m = cflow.load(compiled(name, size), threads=1)
    toks = m.generate(PROMPT, max_new_tokens=tokens, stop=False)
    # one expert's bytes from the file's own tensors: expert 0 of the first bank (every bank has the same shapes)
    expert = sum(t.nbytes for t in m.session.compiled.tensors.values() if t.expert == 0 and t.block == 0)
    per_token = m.bytes_per_token
    m.close()
    it = RouteRecorder(lower(load_graph(f"preset:{name}@{size}"), "q4").graph, act_quant="q8", cache_weights=False)
    it.prefill(PROMPT)
    routes = []
    for t in toks:
        it.step(t)
        routes.append(dict(it.chosen))
    return toks, routes, expert, per_token


def lru_miss(routes, fixed: int, expert: int, cap: int) -> float:
    lru: collections.OrderedDict = collections.OrderedDict()
    miss = total = 0
    layers = sorted(routes[0])
    for r in routes:
        for key, nb in [("fixed", fixed)] + [((layer, e), expert) for layer in layers for e in r[layer]]:
            for k in range(0, nb, PIECE):
                sz = min(PIECE, nb - k)
                total += sz
                if (key, k) in lru:
                    lru.move_to_end((key, k))
                else:
                    miss += sz
                    lru[(key, k)] = None
                    while len(lru) * PIECE > cap:
                        lru.popitem(last=False)
    return miss / total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="114m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cache-mb", default="16,24,28,32")
    add_json_argument(ap, "write one record per preset (no timing: tok_s is null)")
    args = ap.parse_args(argv)
    run = Run("claims_routes", argv)
    records = []
    for name in ("arch1", "arch2_4_combined"):
        toks, routes, expert, total = routes_of(name, args.size, args.tokens)
        layers = sorted(routes[0])
        fixed = total - expert * sum(len(e) for e in routes[0].values())  # the weights every token streams
        same = sum(routes[i][lay] == routes[i - 1][lay] for i in range(1, len(routes)) for lay in layers)
        print(f"{name}: {len(toks)} greedy tokens, {len(set(toks))} distinct; first 16: {toks[:16]}")
        same_share = same / ((len(routes) - 1) * len(layers))
        distinct = [len({e for r in routes for e in r[lay]}) for lay in layers]
        print(f"  same experts as the previous token in {100 * same_share:.0f}% of "
              f"(token, layer); distinct experts per layer over the run: "
              f"{distinct}")
        print(f"  {total / 1e6:.2f} MB per token ({fixed / 1e6:.2f} MB non-expert, {expert / 1e6:.3f} MB per expert)")
        misses = {}
        for mb in (int(x) for x in args.cache_mb.split(",")):
            misses[mb] = miss = lru_miss(routes, fixed, expert, mb << 20)
            print(f"  LRU of {mb} MiB: {100 * miss:.1f}% of the streamed bytes miss")
        records.append(run.record(engine="cflow", model=f"{name}@{args.size}", quant="q4", threads=1,
                                  bytes_per_token=total, tokens=toks, same_experts_share=same_share,
                                  distinct_experts_per_layer=distinct, non_expert_bytes=fixed, expert_bytes=expert,
                                  lru_miss_share_by_mib=misses))
    run.write(args.json, records)


if __name__ == "__main__":
    main()
