"""One JIT library (numba's CodeLibrary idea): LLVM IR in, callable native function addresses out.

Stage: codegen. Input: llvmlite.ir modules or IR text (kernels.py, the compiled schedule).
Output: addresses / ctypes functions in an MCJIT engine that owns the target machine.
Lifecycle: add_ir (parse + verify) ... -> finalize (link, optimise, codegen, or load the
object from the on-disk cache) -> get_function_address. Keep the Library alive while its
functions may run: dropping it frees their code.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time

from ..errors import CodegenError
from .cache import CacheKey, ObjectCache, make_key
from .target import Target, host_target, init_llvm

# NOTE: one process-wide lock around every LLVM call (numba's compiler_lock): LLVM's global
# state (contexts, the pass registry) is not safe under concurrent use from Python threads.
compiler_lock = threading.RLock()


def _llvm():
    import llvmlite.binding as llvm

    init_llvm()
    return llvm


@functools.lru_cache(maxsize=1)
def _host() -> Target:
    return host_target(env=False)


def _check_runnable(target: Target) -> None:
    """Refuse a JIT target that enables a feature this CPU lacks: its code would die on SIGILL."""
    host = _host()
    if target.triple != host.triple:
        raise CodegenError(f"cannot JIT for {target.triple} on a {host.triple} host")
    have = host.feature_map
    missing = sorted(f for f, on in target.feature_map.items() if on and not have.get(f, False))
    if missing:
        raise CodegenError(f"target enables CPU features this host lacks: {', '.join(missing)} "
                           f"(check CFLOW_CPU / CFLOW_FEATURES)")


class Library:
    """A set of IR modules compiled together into one MCJIT engine.

    Args:
        name: module name (shows in dumps).
        target: what to compile for (default: the host, with CFLOW_* overrides).
        opt: optimisation level 0..3 for both the IR pipeline and machine codegen.
        cache: an ObjectCache, None for the default directory, or False to disable caching.
    """

    def __init__(self, name: str = "cflow", target: Target | None = None, opt: int = 3,
                 cache: ObjectCache | None | bool = None):
        llvm = _llvm()
        self.name = name
        self.target = target if target is not None else host_target()
        _check_runnable(self.target)
        self.opt = int(opt)
        if cache is None or cache is True:
            cache = ObjectCache()
        self.cache: ObjectCache | None = cache or None
        with compiler_lock:
            tgt = llvm.Target.from_triple(self.target.triple)
            self._tm = tgt.create_target_machine(cpu=self.target.cpu, features=self.target.features,
                                                 opt=self.opt, jit=True)
        self._texts: list[str] = []
        self._modules: list = []
        self._engine = None
        self._final = None  # the module the engine owns (optimised, or unoptimised on a cache hit)
        self._key: CacheKey | None = None
        self._object: bytes | None = None  # object code from the cache (hit) or from codegen (miss)
        self.stats: dict[str, float | bool] = {}

    # -- building -----------------------------------------------------------------------------

    @property
    def finalized(self) -> bool:
        return self._engine is not None

    def add_ir(self, module) -> None:
        """Add an llvmlite.ir.Module or IR text; it is parsed and verified now."""
        if self.finalized:
            raise CodegenError(f"library {self.name!r}: cannot add IR after finalize")
        text = str(module)
        llvm = _llvm()
        with compiler_lock:
            try:
                mod = llvm.parse_assembly(text)
                mod.verify()
            except RuntimeError as e:
                raise CodegenError(f"library {self.name!r}: invalid LLVM IR: {e}") from None
        self._texts.append(text)
        self._modules.append(mod)

    def finalize(self) -> None:
        """Link, then optimise + codegen, or take the object code from the cache on a hit."""
        if self.finalized:
            return
        llvm = _llvm()
        with compiler_lock:
            if self.finalized:  # another thread finished it while we waited for the lock
                return
            if not self._modules:
                raise CodegenError(f"library {self.name!r}: no IR added")
            t0 = time.perf_counter()
            # Key on the emitted IR (as added), before any LLVM transformation touches it.
            self._key = make_key("\n".join(self._texts), self.target, self.opt)
            cached = self.cache.load(self._key) if self.cache is not None else None
            mod = self._link()
            t1 = time.perf_counter()
            if cached is None:
                self._optimise(mod)
            t2 = time.perf_counter()
            self._object = cached
            engine = llvm.create_mcjit_compiler(mod, self._tm)
            # The engine asks getbuffer before codegen (a hit skips it) and notifies after codegen.
            engine.set_object_cache(self._notify_object, self._get_object)
            engine.finalize_object()
            engine.run_static_constructors()
            self._engine, self._final = engine, mod
            t3 = time.perf_counter()
        self.stats = {"cache_hit": cached is not None, "link_s": t1 - t0, "optimise_s": t2 - t1,
                      "codegen_s": t3 - t2, "total_s": t3 - t0}

    def _link(self):
        mod = self._modules[0]
        for other in self._modules[1:]:
            mod.link_in(other)
        self._modules = []
        mod.name = self.name
        mod.triple = self.target.triple
        mod.data_layout = str(self._tm.target_data)
        return mod

    def _optimise(self, mod) -> None:
        llvm = _llvm()
        pto = llvm.create_pipeline_tuning_options(speed_level=self.opt)
        pto.loop_vectorization = self.opt >= 2
        pto.slp_vectorization = self.opt >= 2
        pb = llvm.create_pass_builder(self._tm, pto)
        pb.getModulePassManager().run(mod, pb)
        try:
            mod.verify()  # again after link + optimise (numba does the same)
        except RuntimeError as e:
            raise CodegenError(f"library {self.name!r}: IR invalid after optimisation: {e}") from None

    # MCJIT object-cache hooks (called inside finalize_object, under compiler_lock).
    def _get_object(self, module) -> bytes | None:
        return self._object

    def _notify_object(self, module, obj: bytes) -> None:
        if self._object is None:
            self._object = bytes(obj)
            if self.cache is not None and self._key is not None:
                self.cache.save(self._key, self._object)

    # -- lookup -------------------------------------------------------------------------------

    def get_function_address(self, name: str) -> int:
        """Native address of function `name` (finalizes on demand)."""
        self.finalize()
        with compiler_lock:
            addr = self._engine.get_function_address(name)
        if not addr:
            raise CodegenError(f"library {self.name!r}: no function named {name!r}")
        return addr

    def get_cfunc(self, name: str, restype, *argtypes):
        """A ctypes function for `name` (ctypes releases the GIL for the duration of each call)."""
        fn = ctypes.CFUNCTYPE(restype, *argtypes)(self.get_function_address(name))
        fn._cflow_library = self  # keep the code alive as long as the function object
        return fn

    # -- dumps --------------------------------------------------------------------------------

    def get_source_str(self) -> str:
        """The IR as emitted (before optimisation): what the cache key hashes."""
        return "\n".join(self._texts)

    def get_llvm_str(self) -> str:
        """The optimised IR (re-derived from the source when the object came from the cache)."""
        return str(self._optimised_module())

    def get_asm_str(self) -> str:
        """Assembly of the optimised module (emitted on demand; the engine keeps no text)."""
        mod = self._optimised_module()
        with compiler_lock:
            return self._tm.emit_assembly(mod)

    def _optimised_module(self):
        """The optimised module, re-derived from the source IR (the pipeline is deterministic).

        NOTE: not the engine's module: MCJIT codegen rewrites IR in place (CodeGenPrepare), and on
        a cache hit that module was never optimised. Dumps are debug aids; recomputing is fine."""
        self.finalize()
        llvm = _llvm()
        with compiler_lock:
            parts = [llvm.parse_assembly(t) for t in self._texts]
            mod = parts[0]
            for other in parts[1:]:
                mod.link_in(other)
            mod.triple = self.target.triple
            mod.data_layout = str(self._tm.target_data)
            self._optimise(mod)
            return mod

    @property
    def object_code(self) -> bytes | None:
        self.finalize()
        return self._object


def compile_ir(*modules, name: str = "cflow", target: Target | None = None, opt: int = 3,
               cache: ObjectCache | None | bool = None) -> Library:
    """Convenience: a finalized Library from one or more modules."""
    lib = Library(name=name, target=target, opt=opt, cache=cache)
    for m in modules:
        lib.add_ir(m)
    lib.finalize()
    return lib


_utility: dict[str, tuple[Library, dict]] = {}
_utility_lock = threading.Lock()


def utility_functions(name: str, build, signatures: dict) -> dict:
    """The ctypes functions of a small helper module (the writer's loops, the bandwidth probe), compiled once per
    process on first use: `build()` returns its llvmlite module; signatures: function name -> (restype,
    *argtypes). The Library (host target) stays alive with them (its code would be freed with it)."""
    with _utility_lock:
        if name not in _utility:
            lib = Library(name=name)
            lib.add_ir(build())
            _utility[name] = (lib, {f: lib.get_cfunc(f, *sig) for f, sig in signatures.items()})
        return _utility[name][1]

