"""The one record schema of every benchmark's --json output, its writer and its reader.

A result file is one JSON object:

    {"schema": 1, "records": [RECORD, ...], "extra": {...}}

"extra" (optional) holds what belongs to the run as a whole rather than to one record: a summary over rounds,
correctness checks, a static table. A RECORD has every key below, in this order; a key the benchmark does not
measure is null (a fuzz run has no tok/s, a kernel benchmark no model):

    engine           what ran: "cflow", "llama.cpp", "ort-genai", "torch-eager", a kernel's or loop's name
    model            the model: a geometry's config name ("tinyllama_geometry"), a preset ("arch1@114m"), a file
    quant            the weight type as the engine names it: "q4", "Q4_0", "int4", "f32"
    isa_path         the ISA path cflow's kernels were built for (cflow.codegen.target.isa_path(): "avx512vnni",
                     "avx2 (forced: CFLOW_FEATURES=...)")
    threads          the threads the engine ran on
    variant          what tells apart records that share the keys above within one run: a load option, a
                     context length, a prompt length, a kernel variant (null when nothing does)
    tok_s            tokens per second: decode unless `variant` says otherwise (a prompt, a batch)
    bytes_per_token  the bytes one token reads (the weights it streams; plus the KV rows where extra says so)
    read_gbs         the machine's read bandwidth, GB/s (10^9 B/s), measured in the same run at the same thread
                     count (cflow.codegen.bandwidth): tok_s x bytes_per_token / 1e9 / read_gbs is the fraction
                     of it a decode reached
    cpu_model        the host (cflow.codegen.target.cpu_model(): name, microarchitecture, CPUID family/model)
    command          the command line that produced the record, run from the repository root
    commit           the git commit of the tree it ran from (12 hex digits), "+dirty" when tracked files differ
    date             when the run started, UTC, ISO 8601
    extra            everything else the benchmark measured, under its own keys

`python -m benchmarks.compare` pairs the records of two files on (engine, model, quant, isa_path, threads,
variant). Without a FILE, --json writes to docs/results/<host kind>/<benchmark>-<date>.json (host_kind()).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time

from . import ROOT

SCHEMA = 1
FIELDS = ("engine", "model", "quant", "isa_path", "threads", "variant", "tok_s", "bytes_per_token", "read_gbs",
          "cpu_model", "command", "commit", "date", "extra")
KEY = ("engine", "model", "quant", "isa_path", "threads", "variant")  # what compare pairs records on
_HOST = object()  # a default that means "this host's, asked when the record is made"


def git_commit(root: str = ROOT) -> str | None:
    """The commit of the tree at `root` (12 hex digits), with "+dirty" when tracked files were modified; None
    outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def host_kind() -> str:
    """The folder name of this host's results under docs/results/: the microarchitecture family the shipped
    kernel choices are keyed by (cflow.codegen.tune_defaults.host_family(): "intel-amx", "znver5", ...), or the
    CPU's model name in lower case with every run of other characters a dash where LLVM names no family."""
    from cflow.codegen.target import cpu_name
    from cflow.codegen.tune_defaults import host_family

    family = host_family()
    if family and family not in ("generic", "x86-64"):
        return family
    return re.sub(r"[^a-z0-9]+", "-", cpu_name().lower()).strip("-") or "unknown"


def default_path(benchmark: str, date: str) -> str:
    """docs/results/<host kind>/<benchmark>-<date as YYYYMMDD-HHMMSS>.json in the repository."""
    stamp = date.replace("-", "").replace(":", "").replace("T", "-").rstrip("Z")
    return os.path.join(ROOT, "docs", "results", host_kind(), f"{benchmark}-{stamp}.json")


def add_json_argument(parser, what: str = "write the records here") -> None:
    """--json [FILE]: without FILE, the default path in docs/results/<host kind>/ (default_path)."""
    parser.add_argument("--json", nargs="?", const="", default=None, metavar="FILE",
                        help=f"{what} (the record schema of benchmarks/common/record.py; no FILE: "
                             "docs/results/<host kind>/<benchmark>-<date>.json)")


class Run:
    """One run of a benchmark: the fields its records share (command, commit, date, CPU) and the writer.

    benchmark: the module's name under benchmarks/ ("decode"); argv: the arguments after it (sys.argv[1:] when
    None), as they make the record's command."""

    def __init__(self, benchmark: str, argv: list[str] | None = None):
        self.benchmark = benchmark
        self.argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
        self.command = shlex.join(["python", "-m", f"benchmarks.{benchmark}", *self.argv])
        self.commit = git_commit()
        self.date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._cpu: str | None = None

    @property
    def cpu_model(self) -> str:
        if self._cpu is None:
            from cflow.codegen.target import cpu_model

            self._cpu = cpu_model()
        return self._cpu

    def record(self, *, engine: str | None = None, model: str | None = None, quant: str | None = None,
               isa_path=_HOST, threads: int | None = None, variant: str | None = None, tok_s: float | None = None,
               bytes_per_token: float | None = None, read_gbs: float | None = None, **extra) -> dict:
        """One record; isa_path defaults to this process's (target.isa_path()), keyword arguments beyond the
        schema's go to its `extra`."""
        if isa_path is _HOST:
            from cflow.codegen.target import isa_path as host_isa_path

            isa_path = host_isa_path()
        return {"engine": engine, "model": model, "quant": quant, "isa_path": isa_path,
                "threads": None if threads is None else int(threads), "variant": variant,
                "tok_s": None if tok_s is None else float(tok_s),
                "bytes_per_token": None if bytes_per_token is None else int(bytes_per_token),
                "read_gbs": None if read_gbs is None else float(read_gbs), "cpu_model": self.cpu_model,
                "command": self.command, "commit": self.commit, "date": self.date, "extra": extra}

    def write(self, path: str | None, records: list[dict], extra: dict | None = None) -> str | None:
        """Write the records (and the run's `extra`) to `path`; "" is the default path, None writes nothing.
        Returns the path written."""
        if path is None:
            return None
        for r in records:
            if tuple(r) != FIELDS:
                raise ValueError(f"not a record of the schema (keys {list(r)}): make it with Run.record")
        path = path or default_path(self.benchmark, self.date)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        doc = {"schema": SCHEMA, "records": records, **({"extra": extra} if extra else {})}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=_jsonable)
            f.write("\n")
        os.replace(tmp, path)  # a partial file is never left under the name
        print(f"# {len(records)} records written to {path}", file=sys.stderr, flush=True)
        return path


def _jsonable(x):
    """NumPy scalars and arrays, sets and other objects a benchmark may leave in `extra`."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (set, frozenset)):
        return list(x)
    return str(x)


# Keys of records written before this schema, and the schema's names for them
_LEGACY = {"read_gbps": "read_gbs", "isa": "isa_path", "cpu": "cpu_model", "geometry": "model"}


def load_results(path: str) -> tuple[list[dict], dict]:
    """(records, the run's extra) of a result file. Files of the schema are returned as they are; older ones
    (a list of records, or an object with "records", each record with its own keys) are read into the schema's
    shape as far as their keys allow (read_gbps, isa, cpu, geometry renamed; the rest in extra), so that two
    older runs can be compared too."""
    with open(path) as f:
        doc = json.load(f)
    if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
        return doc["records"], doc.get("extra", {})
    rows = doc if isinstance(doc, list) else doc.get("records", [])
    top = {} if isinstance(doc, list) else {k: v for k, v in doc.items() if k != "records"}
    records = []
    for r in rows:
        if not isinstance(r, dict):
            continue
        rec = dict.fromkeys(FIELDS)
        rec["extra"] = {}
        for k, v in r.items():
            k = _LEGACY.get(k, k)
            if k in FIELDS and k != "extra" and rec[k] is None:
                rec[k] = v
            else:
                rec["extra"][k] = v
        rec["cpu_model"] = rec["cpu_model"] or top.get("cpu") or top.get("machine")
        records.append(rec)
    return records, top
