"""Staging and the static decode schedule: which kernel steps run in which stage, and where values live.

One decode step = stages separated by barriers. A step is one phase of an op (attention: qkv, core, o;
dense FFN and experts: up, down; the LM head; residual adds). Norms are fused into the prologue of the
step that reads them (each thread normalises its own copy), residual adds into the stage of their last
input (each thread adds its own rows). A step that needs a whole vector runs one stage after the step
that finished it; ops of different layers that the delays make independent share a stage (vertical
pipelining). Values get buffer slots by liveness: the residual ring buffer is the stream slots.
"""

from __future__ import annotations

import enum
from collections import defaultdict

import attrs

from ..errors import PassError
from ..ir import Add, Attention, DenseFFN, Embedding, ExpertBank, Graph, LMHead, RMSNorm, Router
from ..layout import tile as T
from .manager import state_pass
from .pack import node_tensors, post_norm_tensor


class Phase(enum.StrEnum):
    """One kernel phase of an op (the value is what the file's schedule section stores)."""

    EMBED = "embed"  # embedding row -> stream
    QKV = "qkv"  # norm prologue + fused QKV mat-vec
    CORE = "core"  # RoPE, KV-cache write, softmax(qK)V
    O = "o"  # noqa: E741 (attention output projection)
    ROUTE = "route"  # norm prologue + router alone (experts on disk: the choice is known before the experts run)
    UP = "up"  # norm prologue + gate/up mat-vec with SiLU (dense FFN, or router + chosen experts)
    DOWN = "down"  # down mat-vec (experts: weighted sum over the chosen k)
    ADD = "add"  # residual / injection / flush add on this thread's rows
    HEAD = "head"  # final norm prologue + LM head mat-vec


class Pool(enum.StrEnum):
    """Buffer pools: values of one kind share slots of one width (allocated by liveness)."""

    STREAM = "stream"  # residual stream versions (the ring buffer): d_model
    EXPERT = "expert"  # expert outputs pending injection: d_model
    QKV = "qkv"  # fused q|k|v projections
    ATTN = "attn"  # attention output before Wo
    FFN_H = "ffn_h"  # dense FFN hidden
    MOE_H = "moe_h"  # chosen experts' hiddens (+ shared expert)
    LOGITS = "logits"  # vocab


@attrs.frozen
class Step:
    op: str  # IR node name
    phase: Phase
    layer: int
    stage: int
    full_reads: tuple[str, ...]  # values read whole (through a norm, or a whole internal buffer)
    row_reads: tuple[str, ...]  # values read on this thread's own rows only
    writes: tuple[str, ...]
    tensors: tuple[str, ...]  # packed tensors streamed
    nbytes: int  # weight bytes streamed per token (top-k experts only)
    norm: str | None = None  # norm weight fused into the prologue


@attrs.frozen
class Buffer:
    name: str
    pool: Pool
    floats: int
    slot: int
    first: int  # stage written
    last: int  # last stage read


@attrs.frozen
class Schedule:
    name: str
    stages: tuple[tuple[Step, ...], ...]
    buffers: dict
    pools: dict  # pool -> (slots, floats per slot)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def steps(self):
        for st in self.stages:
            yield from st

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "stages": [[attrs.asdict(s) for s in st] for st in self.stages],
            "buffers": {k: attrs.asdict(b) for k, b in self.buffers.items()},
            "pools": {k: list(v) for k, v in self.pools.items()},
        }

    def __str__(self) -> str:
        return format_schedule(self)


def _norm_source(g: Graph, value: str) -> tuple[str, str | None]:
    """A read of %value: through an rmsnorm -> (its input, norm weight), else (value, None)."""
    n = g[value]
    return (n.inputs[0], n.weight) if isinstance(n, RMSNorm) else (value, None)


def build_schedule(g: Graph, tile=T.DEFAULT_TILE, experts_late: bool = False) -> Schedule:
    """Assign every step to the earliest stage its reads allow; allocate buffers by liveness.

    experts_late: the schedule for experts read from disk. The router becomes its own ROUTE step (as
    early as its input allows) and each bank's expert steps move as late as the injection of their
    output allows: de layers of compute between the choice and the use, to hide the expert reads in.
    Nothing else moves (the injection add runs where it did).
    """
    if not experts_late:
        return _build(g, tile, None)
    first = _build(g, tile, {})  # split routes, experts as early as possible: the stages everything else keeps
    banks = {n.name for n in g.nodes() if isinstance(n, ExpertBank)}
    latest: dict[str, int] = {}  # bank value -> stage of the add that injects it (it stays there)
    for st in first.steps():
        if st.phase == Phase.ADD:
            for v in banks & set(st.row_reads):
                latest[v] = st.stage
    return _build(g, tile, latest)


def _build(g: Graph, tile, latest: dict[str, int] | None) -> Schedule:
    """latest is None: the file's schedule (router fused into the experts' up step); else split routes,
    and each bank's down step placed at latest[bank] when that is later than it could run."""
    ready: dict[str, int] = {}  # value -> stage at whose end it is complete
    steps: list[Step] = []

    def add_step(n, phase, stage, full=(), rows=(), writes=(), tensors=(), nbytes=0, norm=None):
        steps.append(Step(op=n.name, phase=phase, layer=n.layer, stage=stage, full_reads=tuple(full),
                          row_reads=tuple(rows), writes=tuple(writes), tensors=tuple(tensors), nbytes=nbytes,
                          norm=norm))
        for w in writes:
            ready[w] = stage

    by_name = {}  # packed tensors of the nodes seen so far
    for n in g.nodes():
        ts = node_tensors(g, n, tile)
        by_name.update((t.name, t) for t in ts)
        if isinstance(n, Embedding):
            add_step(n, Phase.EMBED, 0, writes=[n.name], tensors=[t.name for t in ts], nbytes=0)
        elif isinstance(n, (RMSNorm, Router)):
            continue  # fused into the reading step
        elif isinstance(n, Attention):
            src, norm = _norm_source(g, n.inputs[0])
            s = ready[src] + 1
            by = {t.name: t for t in ts}
            # biases and q/k norm weights (read by the core step) travel with the projection
            qkv = [t for t in ts if t.name.endswith((".wqkv", ".bq", ".bk", ".bv", ".q_norm", ".k_norm"))]
            add_step(n, Phase.QKV, s, full=[src], writes=[f"qkv.{n.layer}"], tensors=[t.name for t in qkv],
                     nbytes=sum(t.nbytes for t in qkv), norm=norm)
            add_step(n, Phase.CORE, s + 1, full=[f"qkv.{n.layer}"], writes=[f"att.{n.layer}"])
            wo = by[f"{n.prefix}.wo"]
            add_step(n, Phase.O, s + 2, full=[f"att.{n.layer}"], writes=[n.name], tensors=[wo.name], nbytes=wo.nbytes)
        elif isinstance(n, DenseFFN):
            src, norm = _norm_source(g, n.inputs[0])
            s = ready[src] + 1
            add_step(n, Phase.UP, s, full=[src], writes=[f"ffn_h.{n.layer}"], tensors=[ts[0].name],
                     nbytes=ts[0].nbytes, norm=norm)
            add_step(n, Phase.DOWN, s + 1, full=[f"ffn_h.{n.layer}"], writes=[n.name], tensors=[ts[1].name],
                     nbytes=ts[1].nbytes)
        elif isinstance(n, ExpertBank):
            src, norm = _norm_source(g, n.inputs[0])
            router = g[n.inputs[1]]
            rt = node_tensors(g, router, tile)
            s = ready[src] + 1
            routed = [t for t in ts if t.expert >= 0]
            shared = [t for t in ts if t.expert < 0]
            e_up = [t for t in routed if t.name.endswith(".w_gate_up")]
            e_down = [t for t in routed if t.name.endswith(".w_down")]
            s_up = [t for t in shared if not t.name.endswith(".w_down")]
            s_down = [t for t in shared if t.name.endswith(".w_down")]
            up, down = e_up + s_up, e_down + s_down
            k_up = n.top_k * e_up[0].nbytes + sum(t.nbytes for t in s_up)
            k_down = n.top_k * e_down[0].nbytes + sum(t.nbytes for t in s_down)
            if latest is None:
                add_step(n, Phase.UP, s, full=[src], writes=[f"moe_h.{n.layer}"], tensors=[t.name for t in rt + up],
                         nbytes=sum(t.nbytes for t in rt) + k_up, norm=norm)
                add_step(n, Phase.DOWN, s + 1, full=[f"moe_h.{n.layer}"], writes=[n.name],
                         tensors=[t.name for t in down], nbytes=k_down)
                continue
            # The route is read by the host after its stage, so the experts start a stage later at the earliest.
            add_step(router, Phase.ROUTE, s, full=[src], tensors=[t.name for t in rt],
                     nbytes=sum(t.nbytes for t in rt), norm=norm)
            su = max(s + 1, latest.get(n.name, 0) - 1)
            sd = max(su + 1, latest.get(n.name, 0))
            add_step(n, Phase.UP, su, full=[src], writes=[f"moe_h.{n.layer}"], tensors=[t.name for t in up],
                     nbytes=k_up, norm=norm)
            add_step(n, Phase.DOWN, sd, full=[f"moe_h.{n.layer}"], writes=[n.name], tensors=[t.name for t in down],
                     nbytes=k_down)
        elif isinstance(n, Add):
            # An input with a post norm (Gemma 2/3's attention / FFN output) is normalised on the way in: its RMS
            # needs the whole vector, so the add waits one stage (a barrier) for every thread's rows of it.
            post = [i for i in n.inputs if getattr(g.get(i), "post_norm", False)]
            pt = [by_name[post_norm_tensor(g[i])] for i in post]
            add_step(n, Phase.ADD, max(ready[i] + (i in post) for i in n.inputs), rows=n.inputs, writes=[n.name],
                     tensors=[t.name for t in pt], nbytes=sum(t.nbytes for t in pt))
        elif isinstance(n, LMHead):
            src, norm = _norm_source(g, n.inputs[0])
            add_step(n, Phase.HEAD, ready[src] + 1, full=[src], writes=[n.name], tensors=[t.name for t in ts],
                     nbytes=sum(t.nbytes for t in ts), norm=norm)
        else:
            raise PassError(f"schedule: no step for %{n.name} ({n.kind})")
    n_stages = max(s.stage for s in steps) + 1
    # NOTE: within a stage, steps keep node order, so a late expert's down step precedes the add reading it.
    stages = tuple(tuple(s for s in steps if s.stage == i) for i in range(n_stages))
    buffers, pools = _allocate(g, steps, n_stages)
    return Schedule(name=g.name, stages=stages, buffers=buffers, pools=pools)


def _pool_of(g: Graph, value: str) -> tuple[Pool, int]:
    """The pool of a value and its width in floats: internal buffers by name, IR values by node kind."""
    c = g.config
    stem = value.split(".")[0]
    if stem == "qkv":
        return Pool.QKV, c.head_dim * (c.n_heads + 2 * c.n_kv_heads)
    if stem == "att":
        return Pool.ATTN, c.head_dim * c.n_heads
    if stem == "ffn_h":
        return Pool.FFN_H, c.ffn_dim
    if stem == "moe_h":
        return Pool.MOE_H, c.top_k * c.expert_dim + c.shared_expert_dim
    node = g.get(value)
    if isinstance(node, ExpertBank):
        return Pool.EXPERT, c.d_model
    if isinstance(node, LMHead):
        return Pool.LOGITS, c.vocab_size
    return Pool.STREAM, c.d_model


def _allocate(g: Graph, steps: list[Step], n_stages: int):
    """Linear scan: a slot is reused only by a value written in a stage after its last read."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for s in steps:
        for w in s.writes:
            first.setdefault(w, s.stage)
            last.setdefault(w, s.stage)
        for r in s.full_reads + s.row_reads:
            last[r] = max(last.get(r, -1), s.stage)
    last["logits"] = n_stages  # read by the host after the step
    free_at: dict[str, list[int]] = defaultdict(list)  # pool -> per slot: last stage it is busy
    buffers: dict[str, Buffer] = {}
    for v in sorted(first, key=lambda v: (first[v], v)):
        pool, floats = _pool_of(g, v)
        slots = free_at[pool]
        slot = next((i for i, busy in enumerate(slots) if busy < first[v]), None)
        if slot is None:
            slot = len(slots)
            slots.append(0)
        slots[slot] = last[v]
        buffers[v] = Buffer(name=v, pool=pool, floats=floats, slot=slot, first=first[v], last=last[v])
    pools = {p: (len(s), _pool_of(g, next(b.name for b in buffers.values() if b.pool == p))[1])
             for p, s in free_at.items()}
    return buffers, pools


def format_schedule(s: Schedule) -> str:
    """Readable, stable text: one line per step, grouped by stage."""
    ring = s.pools.get(Pool.STREAM, (0, 0))[0]
    pend = s.pools.get(Pool.EXPERT, (0, 0))[0]
    total = sum(st.nbytes for st in s.steps())
    lines = [f"schedule {s.name}: {s.n_stages} stages, {sum(len(x) for x in s.stages)} steps, "
             f"residual ring {ring} stream slots + {pend} expert slots, {total:,} weight bytes/token"]
    for i, st in enumerate(s.stages):
        nb = sum(x.nbytes for x in st)
        layers = sorted({x.layer for x in st})
        lines.append(f"stage {i}  (layers {','.join(map(str, layers))}; {nb:,} B)")
        for x in st:
            def slot(v):
                b = s.buffers.get(v)
                return f"%{v}@{b.pool[0:3]}{b.slot}" if b else f"%{v}"
            ins = ([("norm(" + slot(r) + ")") if x.norm else slot(r) for r in x.full_reads]
                   + [slot(r) for r in x.row_reads])
            outs = [slot(w) for w in x.writes]
            extra = f"  [{x.nbytes:,} B]" if x.nbytes else ""
            lines.append(f"  {x.op + '/' + x.phase:<16} {', '.join(ins) or '-':<34} -> {', '.join(outs)}{extra}")
    return "\n".join(lines) + "\n"


@state_pass(name="schedule_stages", requires=("plan_packing",))
def schedule_stages(state, ctx):
    """Stage every kernel step and allocate buffers (the static decode schedule)."""
    return state.evolve(schedule=build_schedule(state.graph, state.tile))
