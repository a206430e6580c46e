"""A memory budget that is real: a child process in its own memory cgroup (v1 or v2), the page cache dropped
before it starts. The limit counts the page cache the process fills (a mapped file's pages too), as a container's
does; the group is made inside this process's own, so an outer limit still holds."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from cflow.util import read_int

V1 = "/sys/fs/cgroup/memory"
V2 = "/sys/fs/cgroup"


def _own(controller: str) -> str:
    """This process's cgroup path for `controller` ('' = v2's unified line)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if (controller == "" and ctrls == "") or controller in ctrls.split(","):
                return path
    return "/"


def controller() -> tuple[str, str] | None:
    """('v1' | 'v2', the directory new groups go in), or None where no memory controller can be written."""
    v1 = os.path.join(V1, _own("memory").lstrip("/"))
    if os.path.exists(os.path.join(v1, "memory.limit_in_bytes")) and os.access(v1, os.W_OK):
        return "v1", v1
    v2 = os.path.join(V2, _own("").lstrip("/"))
    if "memory" in _read(os.path.join(v2, "cgroup.subtree_control")) and os.access(v2, os.W_OK):
        return "v2", v2
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


class MemoryGroup:
    """A memory cgroup limited to `limit` bytes (swap too, where the controller has it); `popen` starts a child
    inside it; `stats` reads its peak usage, limit hits and page-cache share; `close` removes it."""

    def __init__(self, name: str, limit: int, parent: tuple[str, str] | None = None):
        """parent: ('v1' | 'v2', directory) to make the group in (default: controller(), inside this process's
        own group)."""
        found = parent or controller()
        if found is None:
            raise SystemExit("no writable memory cgroup here (run as root on a host with the memory controller)")
        self.kind, parent_dir = found
        self.path = os.path.join(parent_dir, name)
        os.makedirs(self.path, exist_ok=True)
        self.limit = limit
        if self.kind == "v1":
            _write(self._f("memory.limit_in_bytes"), limit)
            if os.path.exists(self._f("memory.memsw.limit_in_bytes")):
                _write(self._f("memory.memsw.limit_in_bytes"), limit)
        else:
            _write(self._f("memory.max"), limit)
            if os.path.exists(self._f("memory.swap.max")):
                _write(self._f("memory.swap.max"), 0)

    def _f(self, name: str) -> str:
        return os.path.join(self.path, name)

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        procs = self._f("cgroup.procs")
        return subprocess.Popen(cmd, preexec_fn=lambda: _write(procs, os.getpid()), **kw)

    def stats(self) -> dict:
        st = {}
        for line in _read(self._f("memory.stat")).splitlines():
            k, _, v = line.partition(" ")
            st[k] = int(v)
        if self.kind == "v1":
            return {"peak": read_int(self._f("memory.max_usage_in_bytes")), "limit_hits":
                    read_int(self._f("memory.failcnt")), "cache": st.get("total_cache"), "rss": st.get("total_rss"),
                    "major_faults": st.get("total_pgmajfault")}
        events = dict(line.split() for line in _read(self._f("memory.events")).splitlines() if line)
        return {"peak": read_int(self._f("memory.peak")), "limit_hits": int(events.get("max", 0)),
                "cache": st.get("file"), "rss": st.get("anon"), "major_faults": st.get("pgmajfault")}

    def close(self) -> None:
        for _ in range(50):  # the group empties once its last task has been reaped
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)
        print(f"# could not remove the memory cgroup {self.path}", file=sys.stderr)


def drop_page_cache(files: list[str], everything: bool = False) -> str:
    """Empty the page cache of `files` before a run (fadvise DONTNEED: the kernel drops their clean pages), or
    all of it with `everything` (drop_caches, root only; other processes then re-read their files). Returns
    which was done."""
    os.sync()
    if everything:
        _write("/proc/sys/vm/drop_caches", 3)
        return "drop_caches"
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def cached_bytes(path: str) -> int:
    """Bytes of `path` in the page cache now (mincore over a read-only mapping; the pages are not touched)."""
    import ctypes
    import mmap

    import numpy as np

    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        view = np.frombuffer(mm, np.uint8)  # its address, without reading a page
        vec = np.zeros((size + page - 1) // page, np.uint8)
        try:
            rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size),
                              ctypes.c_void_p(vec.ctypes.data))
        finally:
            del view
    return -1 if rc else int((vec & 1).sum()) * page
