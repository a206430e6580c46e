"""cflow: a compiler and CPU runtime for pipeline-native transformer decode.

Public surface: ``cflow.compile``, ``cflow.load`` (see api.py) and the CLI (cli/).
Stages live in sub-packages and data flows one way: frontend -> ir -> passes -> codegen/runtime.
"""

__version__ = "0.1.0"

from .errors import CflowError  # noqa: E402


def __getattr__(name):
    # Lazy: importing cflow (or cflow.ir) must not pull in torch, llvmlite or later stages.
    if name in ("compile", "load", "CompiledModel"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'cflow' has no attribute {name!r}")


__all__ = ["compile", "load", "CompiledModel", "CflowError", "__version__"]
