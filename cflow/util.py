"""Small shared helpers with no pipeline-stage meaning: atomic file (and directory) writes, output paths checked
before any work, the memory a process may still allocate.

Every "write somewhere private, then rename over the target" in cflow goes through `atomic_path`:

    with atomic_path("model.gguf") as tmp:   # tmp: .../.model.gguf.<random>.tmp/model.gguf
        write_it(tmp)
    # clean exit: fsync, rename onto model.gguf, fsync the directory; exception: nothing is left

`atomic_write_bytes`, `atomic_write_text` and `atomic_copy` are the one-liners on top of it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

from .errors import CflowError


class atomic_path:  # lower case: used like a function, `with atomic_path(p) as tmp`
    """Publish `path` all at once: readers see the old version or the complete new one, never a part.

    The body gets `tmp`, a fresh path with `path`'s own name inside a private temp directory
    (`.NAME.<random>.tmp`) beside `path`, so writers that name companion files after it still work:
    anything else the body puts beside `tmp` (e.g. ONNX external data `NAME.data`) is published
    beside `path` too, before `path` itself. Files get the usual umask permissions.

    directory=False: the body creates a file at `tmp` (an existing directory at `path` is an error).
    directory=True: `tmp` is an empty directory to fill; a directory already at `path` is swapped out
    (renamed to `.NAME.old`, then removed; `recover_atomic` finishes a swap a crash interrupted).
    durable=True: fsync everything written, and the parent directory after the rename. Pass False
    for caches whose entries are validated on read anyway.

    Parent directories are not created. A missing parent directory, `path` being a directory, or a
    permission problem raise CflowError naming `path`. Without `with` (FileWriter streams across
    calls): `tmp = a.open()`, then `a.commit()` or `a.abort()`; both are idempotent after the first.
    """

    def __init__(self, path: str | os.PathLike, *, directory: bool = False, durable: bool = True):
        self.path = Path(path)
        self.directory = directory
        self.durable = durable
        self.tmp: Path | None = None
        self._stage: Path | None = None

    def open(self) -> Path:
        if self._stage is not None:
            raise RuntimeError(f"atomic_path({self.path}) is already open")
        path = self.path
        if not self.directory and path.is_dir():
            raise CflowError(f"{path} is a directory")
        if self.directory and path.exists() and not path.is_dir():
            raise CflowError(f"{path} exists and is not a directory")
        try:
            self._stage = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
            self.tmp = self._stage / path.name
            if self.directory:
                self.tmp.mkdir()
        except OSError as e:
            self.abort()
            raise _write_error(path, e) from None
        return self.tmp

    def commit(self) -> None:
        """Publish what the body wrote. On any failure nothing is published and the temp is removed."""
        stage, tmp, path = self._stage, self.tmp, self.path
        if stage is None:
            return
        try:
            if not os.path.lexists(tmp) or self.directory != tmp.is_dir():
                what = "a directory" if self.directory else "a file"
                raise CflowError(f"cannot write {path}: {tmp} is not {what} (nothing was written?)")
            if self.durable:
                _fsync_tree(stage)
            for extra in sorted(stage.iterdir()):  # companions first: `path` appears complete
                if extra.name != path.name:
                    os.replace(extra, path.parent / extra.name)
            if self.directory:
                _swap_dir(tmp, path)
            else:
                os.replace(tmp, path)
        except OSError as e:
            self.abort()
            raise _write_error(path, e) from None
        except BaseException:
            self.abort()
            raise
        self.abort()  # removes the (now empty) stage
        if self.durable:
            _fsync_dir(path.parent)

    def abort(self) -> None:
        """Remove the temp directory and everything in it; `path` is not touched."""
        stage, self._stage = self._stage, None
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)

    def __enter__(self) -> Path:
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str, *, durable: bool = True) -> None:
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def check_output_path(path: str | os.PathLike, option: str = "output", *, create_dirs: bool = True) -> Path:
    """Check, before any work, that `path` can be written: not a directory, its directory exists (created,
    with parents, when `create_dirs`, as `cflow export-onnx` does) and accepts a new file (probed by creating
    and removing one, so read-only mounts and permissions are both caught). CflowError names `option`."""
    p = Path(path)
    where = f"{option} {os.fspath(path)}"
    if not os.fspath(path) or p.name in ("", ".", ".."):
        raise CflowError(f"{where}: not a file name")
    if p.is_dir():
        raise CflowError(f"{where}: is a directory (give a file name)")
    parent = p.parent
    if not parent.is_dir():
        if parent.exists() or os.path.islink(parent):
            raise CflowError(f"{where}: {parent} is not a directory")
        if not create_dirs:
            raise CflowError(f"{where}: directory {parent} does not exist")
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CflowError(f"{where}: cannot create directory {parent}: {e.strerror or e}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=parent)
    except OSError as e:
        reason = "permission denied" if isinstance(e, PermissionError) else (e.strerror or str(e))
        raise CflowError(f"{where}: cannot write in {parent}: {reason}") from None
    os.close(fd)
    os.unlink(probe)
    return p


def check_output_dir(path: str | os.PathLike, option: str = "output") -> Path:
    """Check, before any work, that directory `path` can be written: if it exists, that files can be created
    in it; if not, that its parent exists (created if missing) and accepts it. `path` itself is not created."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise CflowError(f"{option} {os.fspath(path)}: exists and is not a directory")
    check_output_path(p / ".cflow-write-probe" if p.is_dir() else p, option)
    return p


def recover_atomic(path: str | os.PathLike) -> None:
    """Clean up after a process killed inside `atomic_path(path)`: finish an interrupted directory
    swap (restore `.NAME.old` if `path` is gone, else drop it) and remove stale `.NAME.*.tmp` temps.
    Only call it while nothing else is writing `path`."""
    path = Path(path)
    _finish_swap(path)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def _old(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def _finish_swap(path: Path) -> None:
    old = _old(path)
    if not old.exists():
        return
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(old, path)


def _swap_dir(new: Path, path: Path) -> None:
    # Two renames, not one: POSIX cannot rename a directory over a non-empty one. A crash between
    # them leaves `path` missing and `.NAME.old` complete; _finish_swap puts it back.
    _finish_swap(path)
    old = _old(path)
    if path.exists():
        os.rename(path, old)
    os.rename(new, path)
    shutil.rmtree(old, ignore_errors=True)


def _write_error(path: Path, e: OSError) -> CflowError:
    parent = path.parent
    if e.errno == errno.ENOENT and not parent.is_dir():
        return CflowError(f"cannot write {path}: directory {parent} does not exist")
    if e.errno == errno.ENOTDIR:
        return CflowError(f"cannot write {path}: {parent} is not a directory")
    if e.errno == errno.EISDIR:
        return CflowError(f"{path} is a directory")
    if isinstance(e, PermissionError):
        return CflowError(f"cannot write {path}: permission denied")
    return CflowError(f"cannot write {path}: {e.strerror or e}")


def _fsync_tree(root: Path) -> None:
    for d, _, files in os.walk(root):
        for name in files:
            _fsync(os.path.join(d, name))
        _fsync_dir(Path(d))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(d: Path) -> None:
    # Makes renames durable; best effort (not every platform or filesystem can fsync a directory).
    try:
        _fsync(str(d))
    except OSError:
        pass


# --- switches --------------------------------------------------------------------------------------
OFF_WORDS = ("off", "0", "no", "false")


def switched_off(name: str, *also: str) -> bool:
    """An environment switch (CFLOW_TUNE, CFLOW_FOLIOS) set to off, 0, no or false (or one of `also`), any case."""
    return os.environ.get(name, "").strip().lower() in OFF_WORDS + also


# --- memory ----------------------------------------------------------------------------------------
def available_memory() -> int | None:
    """Bytes this process may still allocate: the least of the kernel's MemAvailable, the cgroup's limit minus
    its usage (v2 or v1) and the address-space rlimit minus the current address space. None if none is known."""
    found: list[int] = []
    meminfo = _read_kv("/proc/meminfo")
    if "MemAvailable" in meminfo:
        found.append(meminfo["MemAvailable"] * 1024)
    lim, use = cgroup_memory()
    if lim is not None and use is not None:
        found.append(max(0, lim - use))
    left = address_space_left()
    if left is not None:
        found.append(left)
    return min(found) if found else None


def address_space_left() -> int | None:
    """Bytes of address space this process may still map under its RLIMIT_AS (`ulimit -v`), None if unlimited.
    The limit counts what is reserved, not what is resident: thread stacks, malloc arenas, the JIT's pools."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    vm = _read_kv("/proc/self/status").get("VmSize")
    return max(0, soft - (vm or 0) * 1024)


def cgroup_memory(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[int | None, int | None]:
    """The memory limit and usage (bytes, page cache included) of this process's memory cgroup, the nearest
    limited one up its path (v2's memory.max / memory.current, v1's memory.limit_in_bytes / usage_in_bytes);
    (None, None) where no limit is set or none can be read."""
    paths = {"v2": "", "v1": ""}
    try:
        with open(proc) as f:
            for line in f:  # "0::/a/b" (v2), "4:memory:/a/b" (v1)
                _, ctrl, path = line.rstrip("\n").split(":", 2)
                if ctrl == "":
                    paths["v2"] = path
                elif "memory" in ctrl.split(","):
                    paths["v1"] = path
    except (OSError, ValueError):
        pass
    for base, rel, limit, usage in ((root, paths["v2"], "memory.max", "memory.current"),
                                    (os.path.join(root, "memory"), paths["v1"], "memory.limit_in_bytes",
                                     "memory.usage_in_bytes")):
        parts = [p for p in rel.split("/") if p]
        for n in range(len(parts), -1, -1):  # the process's own group first, then each parent (nested limits)
            d = os.path.join(base, *parts[:n])
            lim, use = read_int(os.path.join(d, limit)), read_int(os.path.join(d, usage))
            if lim is not None and use is not None and lim < 2**60:  # "max" / a huge number: no limit
                return lim, use
    return None, None


def format_bytes(n: int | float) -> str:
    """1536 -> '1.5 KiB'; for messages."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


try:  # ISA-L's CRC-32 (the same polynomial as zlib's): 5-7x zlib's speed here, where every expert read and
    # streamed stage is checksummed on arrival (docs/expert-tier.md)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values
    from zlib import crc32 as _crc32


def crc32(data, value: int = 0) -> int:
    """The CRC-32 of `data` (bytes-like) continuing from `value`: zlib.crc32's values."""
    return _crc32(data, value)


def read_int(path: str) -> int | None:
    """A file holding one integer (sysfs, cgroup files); None if it cannot be read as one."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _read_kv(path: str) -> dict[str, int]:
    """'Key:   123 kB' lines -> {Key: 123}."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0])
    except OSError:
        pass
    return out


@contextlib.contextmanager
def small_pages():
    """Inside: numpy gives new arrays ordinary 4 KiB pages, not transparent huge pages (its default for arrays of
    4 MiB and more). For a writer's arrays, made, touched once and freed: a huge page fault may stall for
    compaction (the kernel's THP defrag policy for madvised memory), which costs more than the page faults it
    saves once the page cache is full of the file being written (measured: 0.8 CPU-s per GB written).
    Process-wide while inside (other threads' arrays too); restored on exit."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:  # pragma: no cover - numpy < 2
        try:
            from numpy.core.multiarray import _set_madvise_hugepage
        except ImportError:
            yield
            return
    before = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(before)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; os.cpu_count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def prefetch_map(fn, items, workers: int = 1, name: str = "cflow-prefetch", size=None, ahead_bytes: int = 0):
    """Iterate fn(x) for x in `items`, in order, with the next `workers` results made ahead by as many threads.

    For a writer whose items are expensive to make and cheap to hand on (tensors generated and packed while the
    previous one is checksummed and written: numpy, zlib and file writes release the GIL, so `workers` threads
    use as many cores). At most workers + 1 results exist at once (`workers` being made or waiting, one with the
    consumer); with `size` (x -> its result's bytes) and `ahead_bytes`, more are queued while the results not yet
    consumed hold less than `ahead_bytes`: one large item (an embedding) then keeps one thread while the others
    go on down the list instead of waiting with it. An exception in fn is raised in the consumer at that item;
    when the consumer stops early (break, exception, close), the calls not started are dropped and the running
    ones finish before the generator returns, its threads joined."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, int(workers))
    source = iter(items)
    pending: deque = deque()  # (future, bytes)
    held = [0]  # bytes of the pending results
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def fill() -> None:
        while len(pending) < workers or (size is not None and held[0] < ahead_bytes):
            for x in source:
                nbytes = int(size(x)) if size is not None else 0
                pending.append((pool.submit(fn, x), nbytes))
                held[0] += nbytes
                break
            else:
                return

    try:
        fill()
        while pending:
            future, nbytes = pending.popleft()
            out = future.result()
            held[0] -= nbytes
            fill()  # the next call starts while this result is consumed
            yield out
            del out
    finally:
        for f, _ in pending:
            f.cancel()
        pending.clear()
        pool.shutdown(wait=True)
