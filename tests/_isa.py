"""The ISA paths a test can force on this host, each as a target whose auto-selected kernels are that path's.

The paths below the host's best are forced with feature edits (target.FORCE_FEATURES, CFLOW_FEATURES in a Session
or a CLI run): '-avx512f' leaves AVX-VNNI's 32-byte vpdpbusd where the CPU has it, '-avx512f,-avxvnni,-gfni' the AVX2
kernels (without GFNI, as the CPUs of that path). A path the host cannot run (AVX-VNNI on a Zen 4 or an Ice Lake,
anything above AVX2 on a Zen 3) is None: skipped.
"""

from cflow.codegen.target import forced_env, forced_target, host_target

HOST = host_target(env=False)


def isa_target(isa):
    """A target whose .isa is `isa` on this host, or None."""
    return forced_target(isa)


def isa_env(isa) -> dict[str, str]:
    """The environment that forces `isa` in a Session or a CLI run."""
    return forced_env(isa)


def outputs_on_each_path(script: str) -> dict[str, str]:
    """isa -> standard output of `python -c script` run with that path forced, for every path this host can force
    (the host's own and generic included): what a test compares across paths."""
    import os
    import subprocess
    import sys

    got = {}
    for isa in ("avx512vnni", "avxvnni", "avx2", "generic"):
        if isa_target(isa) is None:
            continue
        out = subprocess.run([sys.executable, "-c", script], env={**os.environ, **isa_env(isa)}, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        got[isa] = out.stdout.strip()
    return got
