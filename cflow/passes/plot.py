"""Stage timeline of a compiled file (`cflow inspect FILE --plot out.png`): bytes per stage and op.

One column per stage, its steps stacked by the weight bytes they stream, coloured by op kind; steps
of ops on the critical path (passes.analysis) are outlined in red, the only red in the plot. The legend sits
outside the axes, so it never hides a bar. Needs matplotlib.
"""

from __future__ import annotations

from ..errors import CflowError
from ..util import atomic_path

COLOURS = {"attn": "#4C72B0", "ffn": "#55A868", "moe": "#CCB974", "logits": "#8172B2", "x0": "#999999"}
CRITICAL = "red"  # outline of a critical-path step; no fill colour comes near it


def plot_schedule(header: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise CflowError("--plot needs matplotlib (pip install matplotlib)") from None
    from ..ir import build_graph
    from ..ir.config import ModelConfig
    from ..layout import STORED
    from ..layout.quant import DType
    from .analysis import analyze

    cfg = ModelConfig.from_dict(header["config"])
    g = build_graph(cfg)
    if header["quant"] == STORED:  # each weight at the type the header lists (a GGUF's, or a type mix's)
        g.meta.weight_dtypes = {n: DType.parse(t) for n, t in (header.get("weight_dtypes") or {}).items()}
    crit = set(analyze(g, header["quant"]).critical_path)
    stages = header["schedule"]["stages"]
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(stages)), 4.5))
    kinds = []  # op kinds in the order they first appear: one legend entry each
    for i, stage in enumerate(stages):
        bottom = 0.0
        for st in stage:
            mb = st["nbytes"] / 1e6
            if mb <= 0:
                continue
            kind = st["op"].split(".")[0]
            if kind not in kinds:
                kinds.append(kind)
            on = st["op"] in crit
            ax.bar(i, mb, bottom=bottom, color=COLOURS.get(kind, "#777777"),
                   edgecolor=CRITICAL if on else "white", linewidth=1.8 if on else 0.5)
            if mb > 0.04 * max(1e-9, sum(s["nbytes"] for s in stage) / 1e6):
                ax.text(i, bottom + mb / 2, f"{st['op']}/{st['phase']}", ha="center", va="center", fontsize=5,
                        rotation=90)
            bottom += mb
    ax.set_xlabel("stage (barrier after each)")
    ax.set_ylabel("weight MB streamed")
    dd, de = header["delays"]
    ax.set_title(f"{header.get('name')} (dd={dd}, de={de}, {header['quant']}): {len(stages)} stages")
    handles = [Patch(facecolor=COLOURS.get(k, "#777777"), edgecolor="white", label=k) for k in kinds]
    handles.append(Patch(facecolor="none", edgecolor=CRITICAL, linewidth=1.8, label="critical path"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    fig.tight_layout()
    try:
        with atomic_path(out) as tmp:  # tmp keeps out's name: savefig picks the format from its extension
            fig.savefig(tmp, dpi=130)
    finally:
        plt.close(fig)
