"""Per-tensor weight types under a bits-per-weight budget (cflowc --bpw / --quant auto).

    measure(graph, imatrix)      every matrix quantised at every type it can take (importance-weighted,
                                 layout/quantize_blocks.py); its error sum_j imatrix_j (w - w')^2 per type
    sensitivities(...)           a KLD probe: each matrix alone quantised at Q4_0, the mean KL divergence it adds over
                                 calibration tokens, per unit of its error; errors times these are predicted KLDs,
                                 comparable across tensors (a raw squared error is not: an ffn_down error reaches
                                 the residual directly, an ffn_gate error through the gate)
    allocate(options, budget)    the types minimising the summed error with total bits <= budget: greedy steps along
                                 each tensor's lower convex hull of (bits, error), best error drop per bit first
                                 (the Lagrangian optimum at every hull point), then any single upgrade that still fits
    plan_mix(...)                both, as a MixPlan (types, errors, bpw: what cflowc prints and the header stores)
    apply_plan(graph, plan, im)  the graph with every matrix quantised lazily at its planned type (quant "stored")

Bits per weight count every matrix the file stores (the token embedding and an untied head included; the f32
router and gate weights at 32 bits), over their elements: the figure llama.cpp's file sizes give. The token
embedding is read by row, not multiplied: its error is the normalised first-layer input's (the first attention
norm's weights squared over the embedding's mean square), per token (divided by the vocabulary).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping

import attrs
import numpy as np

from ..errors import CflowError
from ..ir.interp import log_softmax
from ..layout.blocks import OWN_TYPES
from ..layout.quant import BLOCK_SIZES, DType, dequantize, dequantize_rows, matrix_bytes
from ..layout.quantize_blocks import OwnRangeError, own_limit, quantize_weighted, weighted_error
from ..util import prefetch_map, usable_cpus
from . import gptq
from .quantize import F32_SUFFIXES

# the types a mix chooses from: every block type cflow executes, cheapest first
CANDIDATES = (DType.Q2_K, DType.Q3_128, DType.Q3_192, DType.Q3_K, DType.IQ4_XS, DType.IQ4_128, DType.IQ4_192, DType.Q4,
              DType.IQ4_NL, DType.Q4_K, DType.Q4_1, DType.Q5_0, DType.Q5_K, DType.Q5_1, DType.Q6_K, DType.Q8)
# llama.cpp's types only (cflowc --mix-types gguf): a mix a GGUF can hold (GGUF export refuses cflow's own types)
GGUF_CANDIDATES = tuple(d for d in CANDIDATES if d not in OWN_TYPES)
# what a mix without a calibration text (--quant auto, the default for a float model) chooses from: all but cflow's
# own 3-bit types. Its errors are unweighted and unprobed, so its allocation is a guess: Q3_128 took the bundled
# model's untied embedding and doubled the mix's KLD (0.031 against 0.016), where Q2_K on Qwen2.5-Coder-1.5B's
# untied embedding was the right guess (KLD 0.0077; 0.0142 without the types below 4 bits). docs/quantization.md
def auto_types(types=None) -> tuple:
    return tuple(d for d in (types or CANDIDATES) if d not in (DType.Q3_128, DType.Q3_192))


DEFAULT_BPW = 4.5
MEASURE_WORKERS = 4  # threads measuring matrices at once


def bits(shape, dt: DType) -> int:
    return matrix_bytes(shape[0], shape[1], dt) * 8


def candidates(shape, types=CANDIDATES) -> list[DType]:
    """The types a [rows, cols] matrix can be stored at whole (cols a multiple of the type's block)."""
    return [dt for dt in types if shape[1] % BLOCK_SIZES[dt][0] == 0]


def matrices(graph) -> list[str]:
    """The matrices a mix types: every 2-D weight but the f32 router and gates."""
    return [n for n, s in graph.meta.shapes.items() if len(s) == 2 and not n.endswith(F32_SUFFIXES)]


def _embedding_weights(graph, head_reads_it: bool) -> np.ndarray | None:
    """The error weight per column of an untied token embedding (module docstring); None for a tied one (its
    importance is the head's)."""
    if head_reads_it:
        return None
    e = dequantize(graph.weights["tok_embeddings"])
    norm = graph.weights.get("blocks.0.attn_norm")
    g2 = np.ones(e.shape[1], np.float32) if norm is None else np.asarray(norm, np.float32) ** 2
    return (g2 / max(float((e * e).mean()), 1e-30) / e.shape[0]).astype(np.float32)


def column_weights(graph, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray | None]:
    """The imatrix each matrix is fit and measured with (a floor at 1e-4 of its mean keeps every block fit)."""
    head = graph["logits"].weight
    out: dict[str, np.ndarray | None] = {}
    for n in matrices(graph):
        v = values.get(n)
        if n == "tok_embeddings" and v is None:
            v = _embedding_weights(graph, head == n)
        if v is not None:
            v = np.asarray(v, np.float32)
            m = float(v[np.isfinite(v)].mean()) if np.isfinite(v).any() else 0.0
            v = None if m <= 0 else np.maximum(np.nan_to_num(v, nan=m, posinf=m), 1e-4 * m).astype(np.float32)
        out[n] = v
    return out


def curvatures(grams: Mapping[str, np.ndarray]) -> dict[str, gptq.Curvature]:
    """name -> its input's Curvature (passes/gptq.py), one per shared gram (q, k and v factor one matrix)."""
    made: dict[int, gptq.Curvature] = {}
    return {n: made.setdefault(id(g), gptq.Curvature(g)) for n, g in grams.items()}


def quantize_one(name: str, w: np.ndarray, dt: DType, weights: Mapping[str, np.ndarray | None],
                 curv: Mapping[str, gptq.Curvature] | None = None):
    """w at dt: with the error fed forward where the matrix's curvature is known (GPTQ), else importance-weighted."""
    c = (curv or {}).get(name)
    if c is not None:
        return gptq.quantize(w, dt, c)
    return quantize_weighted(w, dt, weights.get(name))


def error_of(name: str, w: np.ndarray, t, weights: Mapping[str, np.ndarray | None],
             curv: Mapping[str, gptq.Curvature] | None = None) -> float:
    """The expected squared output error of t for w: through the full curvature where known, else its diagonal."""
    c = (curv or {}).get(name)
    return gptq.output_error(w, t, c) if c is not None else weighted_error(w, t, weights.get(name))


def measure(graph, weights: Mapping[str, np.ndarray | None], types=CANDIDATES, sample_rows: int = 256,
            progress=None, curv: Mapping[str, gptq.Curvature] | None = None) -> dict[str, dict[DType, float]]:
    """name -> {type: expected squared output error} for every matrix and every type it can take, estimated on
    `sample_rows` evenly spaced rows (scaled to the whole matrix: blocks never span rows, nor does error feedback)."""
    names = matrices(graph)

    def one(n):
        t = graph.weights[n]
        shape = tuple(t.shape)
        rows = np.unique(np.linspace(0, shape[0] - 1, min(sample_rows, shape[0])).astype(int))
        ws, scale = dequantize_rows(t, rows), shape[0] / rows.size
        # an own type holds values up to own_limit: a float matrix is checked whole (cheap), a stored one on its
        # sampled rows (a row beyond it elsewhere fails by name when the file is written)
        kinds = candidates(shape, types)
        own = [dt for dt in kinds if dt in OWN_TYPES]
        top = float(np.abs(t).max()) if own and isinstance(t, np.ndarray) and t.size else 0.0
        errs = {}
        for dt in kinds:
            if dt in own and not top <= own_limit(dt):
                continue
            try:
                errs[dt] = scale * error_of(n, ws, quantize_one(n, ws, dt, weights, curv), weights, curv)
            except OwnRangeError:  # values an own type cannot hold: not a candidate here
                pass
        if not errs:
            raise CflowError(f"{n}: {shape[1]} inputs per row fit no block type (a multiple of 32 is needed)")
        return errs

    out = {}
    # a thread per core (at most MEASURE_WORKERS: each holds a matrix): the native fitters and NumPy's large
    # operations release the GIL. Curvatures shared between matrices are factored first, not in two threads at once.
    for c in {id(c): c for c in (curv or {}).values()}.values():
        c.factor()
    workers = min(usable_cpus(), MEASURE_WORKERS)
    for i, (n, errs) in enumerate(zip(names, prefetch_map(one, names, workers=workers))):
        out[n] = errs
        if progress is not None:
            progress(i + 1, len(names), n)
    return out


def groups(names) -> dict[str, list[str]]:
    """The matrices that take one type together: gate and up (one fused kernel reads both), and a bank's experts
    (their gate+up, their down: one type per bank, as a GGUF stores them). Key: the group's name."""
    out: dict[str, list[str]] = {}
    for n in names:
        key = re.sub(r"\.w_(gate|up)$", ".w_gate_up", n)
        key = re.sub(r"\.experts\.\d+\.", ".experts.*.", key)
        out.setdefault(key, []).append(n)
    return out


def sensitivities(graph, weights: Mapping[str, np.ndarray | None], errors: dict[str, dict[DType, float]], ids,
                  probe: DType = DType.Q4, progress=None, curv: Mapping[str, gptq.Curvature] | None = None
                  ) -> dict[str, float]:
    """name -> mean KL divergence (nats per token, over `ids`) its group adds when quantised at `probe`, per unit of
    the group's weighted error there: the factor that turns an error into a predicted KLD (module docstring).
    One float forward pass per group (the reference interpreter, that group alone swapped)."""
    run = _Replay(graph, ids)
    logp = log_softmax(run.logits)
    p = np.exp(logp)
    out = {}
    todo = {k: v for k, v in groups(matrices(graph)).items() if all(probe in errors.get(n, {}) for n in v)}
    for i, (key, members) in enumerate(todo.items()):
        swap = {n: dequantize(quantize_one(n, np.asarray(run.weight(n), np.float32), probe, weights, curv))
                for n in members}
        lq = log_softmax(run.replay(swap))
        kld = float((p * (logp - lq)).sum(1).mean())
        err = sum(errors[n][probe] for n in members)
        for n in members:
            out[n] = max(kld, 0.0) / max(err, 1e-30)
        if progress is not None:
            progress(i + 1, len(todo), key)
    floor = 1e-3 * (float(np.mean(list(out.values()))) if out else 1.0)
    return {n: max(s, floor) for n, s in out.items()}


class _Replay:
    """The reference interpreter over one chunk, re-run with some weights swapped from the first node that reads
    one of them (every value before it, and the KV cache of the attention before it, kept from the first run)."""

    def __init__(self, graph, ids):
        from ..ir.graph import INPUT
        from ..ir.interp import Interpreter

        self.run = Interpreter(graph, max_seq_len=len(ids))
        self.logits = self.run.run(ids)
        self.values = dict(self.run.values, **{INPUT: np.asarray(ids, np.int64)})
        self.kv = dict(self.run.kv)
        self.order = self.run.order

    def weight(self, name):
        return self.run.weight(name)

    def _reads(self, node, names) -> bool:
        w = set(getattr(node, "weights", ()) or ())
        if getattr(node, "weight", None):
            w.add(node.weight)
        prefix = getattr(node, "prefix", None)
        return bool(w & names) or (prefix is not None and any(n.startswith(prefix + ".") for n in names))

    def replay(self, swap: dict) -> np.ndarray:
        from ..ir.graph import OUTPUT

        names = set(swap)
        first = next(i for i, n in enumerate(self.order) if self._reads(n, names))
        keep = {n: self.run._dense.get(n) for n in swap}
        self.run._dense.update(swap)
        before = {n.name for n in self.order[:first]}
        vals = {k: v for k, v in self.values.items() if k not in {n.name for n in self.order[first:]}}
        self.run.pos, self.run.kv = 0, {k: v for k, v in self.kv.items() if k in before}
        try:
            for node in self.order[first:]:
                vals[node.name] = self.run._exec(node, vals)
        finally:
            for n, w in keep.items():
                if w is None:
                    self.run._dense.pop(n, None)
                else:
                    self.run._dense[n] = w
        return vals[OUTPUT]


def predicted(errors: dict[str, dict[DType, float]], sens: Mapping[str, float]) -> dict[str, dict[DType, float]]:
    """Each error scaled by its tensor's sensitivity: a predicted KLD per tensor and type."""
    return {n: {dt: e * sens.get(n, 1.0) for dt, e in errs.items()} for n, errs in errors.items()}


def _hull(opts: list[tuple[int, float, DType]]) -> list[tuple[int, float, DType]]:
    """Lower convex hull of (bits, error), bits ascending, error strictly falling."""
    pts = []
    for b, e, dt in sorted(opts, key=lambda o: (o[0], o[1])):
        if pts and e >= pts[-1][1]:
            continue  # more bits, no less error: never worth it
        while len(pts) >= 2:
            (b1, e1, _), (b2, e2, _) = pts[-2], pts[-1]
            if (e1 - e2) * (b - b2) <= (e2 - e) * (b2 - b1):  # the middle point lies on or above the chord
                pts.pop()
            else:
                break
        pts.append((b, e, dt))
    return pts


def allocate(options: dict[str, list[tuple[int, float, DType]]], budget_bits: float) -> dict[str, DType]:
    """One option (bits, error, type) per tensor, minimising the summed error with the summed bits <= budget_bits.
    CflowError if even the cheapest mix exceeds it."""
    hulls = {n: _hull(o) for n, o in options.items()}
    at = {n: 0 for n in hulls}
    total = sum(h[0][0] for h in hulls.values())
    if total > budget_bits:
        raise CflowError("no type mix fits the budget")
    heap = []

    def push(n):
        h, i = hulls[n], at[n]
        if i + 1 < len(h):
            gain = (h[i][1] - h[i + 1][1]) / (h[i + 1][0] - h[i][0])
            heapq.heappush(heap, (-gain, n))

    for n in hulls:
        push(n)
    while heap:
        _, n = heapq.heappop(heap)
        h, i = hulls[n], at[n]
        step = h[i + 1][0] - h[i][0]
        if total + step <= budget_bits:
            total += step
            at[n] = i + 1
            push(n)
    chosen = {n: hulls[n][at[n]] for n in hulls}
    while True:  # leftover bits: the best single upgrade off the hull that still fits
        best = None
        for n, opts in options.items():
            b0, e0, _ = chosen[n]
            for b, e, dt in opts:
                if b > b0 and e < e0 and total + b - b0 <= budget_bits:
                    g = (e0 - e) / (b - b0)
                    if best is None or g > best[0]:
                        best = (g, n, (b, e, dt))
        if best is None:
            break
        _, n, o = best
        total += o[0] - chosen[n][0]
        chosen[n] = o
    return {n: o[2] for n, o in chosen.items()}


@attrs.define
class MixPlan:
    """The chosen type of every matrix, its error at that type and at the others, and the resulting bpw."""

    types: dict[str, DType]
    errors: dict[str, dict[DType, float]]
    bpw: float
    budget: float
    imatrix: str = ""

    def table(self, shapes) -> str:
        lines = [f"{'tensor':<36} {'type':<7} {'bpw':>6} {'error':>11}  (error at the other types)"]
        for n, dt in self.types.items():
            others = "  ".join(f"{d.gguf_name} {e:.3g}" for d, e in self.errors[n].items() if d != dt)
            lines.append(f"{n:<36} {dt.gguf_name:<7} {bits(shapes[n], dt) / np.prod(shapes[n]):>6.3f} "
                         f"{self.errors[n][dt]:>11.4g}  {others}")
        lines.append(f"{len(self.types)} matrices: {self.bpw:.3f} bits per weight (budget {self.budget:g}), "
                     f"total error {sum(self.errors[n][dt] for n, dt in self.types.items()):.4g}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"bpw": round(self.bpw, 4), "budget": self.budget, "imatrix": self.imatrix,
                "tensors": {n: {"type": dt.gguf_name, "error": self.errors[n][dt]} for n, dt in self.types.items()}}


def fixed_bits(graph) -> tuple[int, int]:
    """(bits, elements) of the matrices a mix does not type (f32 router and gates)."""
    fixed = [s for n, s in graph.meta.shapes.items() if len(s) == 2 and n.endswith(F32_SUFFIXES)]
    return sum(32 * s[0] * s[1] for s in fixed), sum(s[0] * s[1] for s in fixed)


def _options(graph, errors: dict[str, dict[DType, float]]):
    """(each group's (bits, error, type) options, the groups, the fixed bits and the elements they count over, the
    smallest bits per weight any mix has) for the types `errors` measured."""
    shapes = graph.meta.shapes
    fb, fe = fixed_bits(graph)
    elems = sum(int(np.prod(shapes[n])) for n in errors) + fe
    options = {}
    members = groups(errors)
    for key, names in members.items():
        common = [dt for dt in errors[names[0]] if all(dt in errors[n] for n in names)]
        if not common:
            raise CflowError(f"{key}: its matrices share no block type ({', '.join(names)})")
        options[key] = [(sum(bits(shapes[n], dt) for n in names), sum(errors[n][dt] for n in names), dt)
                        for dt in common]
    floor = (sum(min(o[0] for o in opts) for opts in options.values()) + fb) / elems
    return options, members, fb, elems, floor


def smallest_bpw(graph, types=CANDIDATES) -> float | None:
    """The fewest bits per weight a type mix of the graph can have (every matrix at its cheapest type), or None if
    a matrix takes no block type (a width not a multiple of 32); from the shapes alone."""
    try:
        return _options(graph, {n: dict.fromkeys(candidates(graph.meta.shapes[n], types), 0.0)
                                for n in matrices(graph)})[4]
    except CflowError:
        return None


def plan_mix(graph, errors: dict[str, dict[DType, float]], bpw: float, imatrix: str = "") -> MixPlan:
    """The types of `errors`' matrices minimising their summed error at <= bpw bits per weight (module docstring);
    the matrices of a group (groups()) take one type."""
    shapes = graph.meta.shapes
    options, members, fb, elems, floor = _options(graph, errors)
    if bpw < floor:
        raise CflowError(f"--bpw {bpw:g}: no type mix of {graph.name} fits; the smallest is {floor:.3f} bits per "
                         "weight (every matrix at its cheapest type)")
    chosen = allocate(options, bpw * elems - fb)
    types = {n: chosen[key] for key, names in members.items() for n in names}
    used = (sum(bits(shapes[n], dt) for n, dt in types.items()) + fb) / elems
    return MixPlan(types=types, errors=errors, bpw=used, budget=bpw, imatrix=imatrix)


class WeightedQuantized(Mapping):
    """`source` weights, every planned matrix quantised on access at its type with its importance weights (and its
    curvature where known: quantize_one)."""

    def __init__(self, source: Mapping, types: Mapping[str, DType], weights: Mapping[str, np.ndarray | None],
                 curv: Mapping[str, gptq.Curvature] | None = None):
        self.source, self.types, self.weights, self.curv = source, types, weights, curv

    def __getitem__(self, name: str):
        w = self.source[name]
        dt = self.types.get(name)
        if dt is None:
            return w
        try:
            return quantize_one(name, dequantize(w), dt, self.weights, self.curv)
        except OwnRangeError as e:  # an own type's range exceeded by a row the measuring did not sample
            raise CflowError(f"{name}: {e}; compile with --mix-types gguf to leave cflow's own types out") from e

    def __iter__(self):
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)


def uniform(graph, q: DType) -> dict[str, DType]:
    """Every matrix at q, the token embedding included (a tied head streams it: it is not copied at f16)."""
    return {n: q for n in matrices(graph)}


def apply_types(graph, types: Mapping[str, DType], weights: Mapping[str, np.ndarray | None],
                report: dict | None = None, curv: Mapping[str, gptq.Curvature] | None = None):
    """A copy of `graph` whose matrices are quantised (lazily, importance-weighted) at `types`, compiled as stored
    (quant "stored"); f16 / f32 types are converted as usual."""
    for n, dt in types.items():
        shape = graph.meta.shapes.get(n)
        if shape is None or len(shape) != 2:
            raise CflowError(f"{n}: not a matrix of {graph.name}")
        if dt.quantised and dt not in candidates(shape, (dt,)):
            raise CflowError(f"{n}: {shape[1]} inputs per row are not whole {dt.gguf_name} blocks of "
                             f"{BLOCK_SIZES[dt][0]}")
    g = graph.copy()
    stored = {n: DType.F32 for n, s in g.meta.shapes.items() if len(s) == 1 or n.endswith(F32_SUFFIXES)}
    stored.update(types)
    g.meta.source_dtypes = stored
    g.meta.quant_mix = report
    g.weights = WeightedQuantized(graph.weights, {n: dt for n, dt in types.items() if dt.quantised}, weights, curv)
    return g


def auto_mix(graph, budget: float = DEFAULT_BPW, progress=None, sample_rows: int = 256, types=CANDIDATES):
    """(graph with each matrix's type chosen within `budget` bits per weight by its unweighted error, the plan):
    `--quant auto` without a calibration text, cflowc's default for a float model and the API's quant="auto"; of
    `types`, those auto_types keeps."""
    weights = column_weights(graph, {})
    plan = plan_mix(graph, measure(graph, weights, auto_types(types), sample_rows=sample_rows, progress=progress),
                    budget)
    return apply_types(graph, plan.types, weights, {**plan.to_json(), "gptq": False}), plan
