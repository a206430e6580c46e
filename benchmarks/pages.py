"""Decode from the same weights in small page-cache folios vs 2 MiB folios, in alternating rounds of one run.

    python -m benchmarks.pages [--threads 1,2] [--rounds 5] [--tokens 32] [--json [FILE]]
    python -m benchmarks.pages --report FILE [FILE ...]    # how much of each file maps in 2 MiB folios now

cflow maps a model file with MADV_HUGEPAGE (runtime/format/folios.py), so pages read from disk come in 2 MiB folios
where the file system keeps large folios (ext4 since Linux 6.16); FileWriter drops what it wrote from the page
cache, and a load drops the parts of a file cached in small folios (folios.mend), to be read back in 2 MiB ones.
This script makes three copies of the TinyLlama-geometry Q4 file (benchmarks/common/models.py builds it), two of them
written with 128 KiB writes and left in the cache (small folios, as a file just copied or written by another
tool): `small` is loaded with CFLOW_FOLIOS=keep (the cache as it was), `mended` loaded as cflow.load does by
default; `huge` is dropped from the cache and read back through cflow's mapping. It prints what each load's
survey found, how much of each mapping the kernel maps with PMDs (FilePmdMapped in /proc/self/smaps), then tok/s
of all three in alternating rounds with the read bandwidth of each round.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import time

import numpy as np

import cflow
from benchmarks.common import OUT
from benchmarks.common.bandwidth import read_gbs
from benchmarks.common.models import MODELS, compiled_model
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import busy_fraction, time_decode
from cflow.codegen.target import cpu_model
from cflow.runtime.format.folios import drop_cached, survey


def pmd_mapped_kib(path: str) -> tuple[int, int]:
    """(Rss, FilePmdMapped) in KiB of this process's mapping of `path` (0, 0 when not mapped)."""
    with open("/proc/self/smaps") as f:
        text = f.read()
    at = text.find(os.path.realpath(path))
    if at < 0:
        return 0, 0
    block = text[at:].split("VmFlags", 1)[0]

    def field(name):
        m = re.search(name + r":\s+(\d+) kB", block)
        return int(m.group(1)) if m else 0

    return field("Rss"), field("FilePmdMapped")


def report(paths: list[str]) -> None:
    """Map each file as cflow.load does (FileReader: MADV_HUGEPAGE), touch every page, print how much of it the
    kernel maps with PMDs: pages cached earlier in small folios (written by another tool, or reclaimed and read
    back) stay small, whatever the advice."""
    from cflow.runtime.format import FileReader

    print(f"# {cpu_model()}")
    for p in paths:
        with FileReader(p) as r:
            t0 = time.perf_counter()
            found = survey(r._mm)  # what a load's survey sees (cached chunks only), before anything is faulted in
            took = time.perf_counter() - t0
            buf = np.frombuffer(r._buf, np.uint8)
            int(buf[::4096].sum())  # fault every page in: the kernel's own count (smaps) as a cross-check
            rss, pmd = pmd_mapped_kib(p)
            del buf
        print(f"{p}: PMD-mapped {pmd / 1024:.1f} of {rss / 1024:.1f} MiB resident ({100 * pmd / max(rss, 1):.0f}%); "
              f"survey before: {found if found is not None else 'not possible here'} ({1e3 * took:.1f} ms)")


def copies(src: str) -> dict[str, str]:
    """{'small': path, 'mended': path, 'huge': path}: the copies of src described in the module docstring."""
    out = {}
    for kind in ("small", "mended", "huge"):
        dst = os.path.join(OUT, f"pages_{kind}.vflow")
        with open(src, "rb") as a, open(dst, "wb") as b:
            shutil.copyfileobj(a, b, 128 << 10)
            b.flush()
            os.fsync(b.fileno())
        if kind == "huge":
            drop_cached(dst)  # as FileWriter does after its commit
        out[kind] = dst
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--gib", type=float, default=1.0, help="read-bandwidth buffer")
    add_json_argument(ap, "write one record per page kind and thread count")
    ap.add_argument("--report", nargs="+", metavar="FILE", help="only print how much of these files maps in 2 MiB "
                    "folios (no decode)")
    args = ap.parse_args(argv)
    run = Run("pages", argv)
    if args.report:
        report(args.report)
        return
    config = MODELS["tinyllama"]
    path, _ = compiled_model("tinyllama", "q4")
    files = copies(path)
    prompt = list(range(1, 9))
    records = []
    print(f"# {cpu_model()}; {config.name} q4; {args.rounds} alternating rounds of {args.tokens} tokens (best of 2)")
    for threads in (int(t) for t in args.threads.split(",")):
        models = {}
        saved = os.environ.get("CFLOW_FOLIOS")
        try:
            for k, p in files.items():
                os.environ["CFLOW_FOLIOS"] = "keep" if k == "small" else "mend"
                models[k] = cflow.load(p, threads=threads)
                print(f"  {k:<6} load: {models[k].session.folios}")
        finally:
            if saved is None:
                os.environ.pop("CFLOW_FOLIOS", None)
            else:
                os.environ["CFLOW_FOLIOS"] = saved
        for m in models.values():
            time_decode(m, prompt, 4, 1)  # faults every page in (2 MiB folios where the cache allows)
        cover = {k: pmd_mapped_kib(p) for k, p in files.items()}
        tps = {k: [] for k in files}
        reads, loads = [], []
        for r in range(args.rounds):
            reads.append(read_gbs(threads, args.gib))
            for k in (files if r % 2 == 0 else reversed(list(files))):
                t, busy = busy_fraction(lambda m=models[k]: time_decode(m, prompt, args.tokens, 2))
                tps[k].append(t)
                loads.append(busy)
        read = float(np.median(reads))
        bpt = models["huge"].bytes_per_token
        ratios = {k: [h / s for h, s in zip(tps[k], tps["small"])] for k in ("mended", "huge")}
        print(f"threads={threads}  read {read:.2f} GB/s (median of {args.rounds})  other load {100 * max(loads):.0f}%"
              " max")
        for k in files:
            rss, pmd = cover[k]
            t = float(np.median(tps[k]))
            print(f"  {k:<6} PMD-mapped {pmd / 1024:7.1f} of {rss / 1024:7.1f} MiB   {t:7.2f} tok/s  "
                  f"{100 * t * bpt / 1e9 / read:5.1f}% of read")
            records.append(run.record(engine="cflow", model=config.name, quant="q4", threads=threads,
                                      variant=f"pages {k}", tok_s=round(t, 3), bytes_per_token=bpt,
                                      read_gbs=round(read, 3), pages=k, tok_s_rounds=tps[k], read_rounds=reads,
                                      rss_kib=rss, pmd_mapped_kib=pmd, other_load=round(max(loads), 3),
                                      tuning=models[k].session.tuning, load_survey=str(models[k].session.folios)))
        for k, rs in ratios.items():
            print(f"  {k} / small: median of per-round ratios {np.median(rs):.3f} "
                  f"(rounds {', '.join(f'{x:.2f}' for x in rs)})")
        for m in models.values():
            m.close()
    for p in files.values():
        os.unlink(p)
    run.write(args.json, records)


if __name__ == "__main__":
    main()
