"""Sub-commands of `cflow`, one module each in cflow/cmd/: NAME.py defines HELP, add_args(parser), run(args).

The module name is the command (underscores become dashes: export_onnx.py -> `cflow export-onnx`).
Modules are imported only to build the parser, and each should import heavy things inside run().
"""

from __future__ import annotations

import importlib
import pkgutil


def load_commands() -> dict:
    """name -> (help, add_args, run), sorted by name."""
    from . import cmd

    out = {}
    for info in sorted(pkgutil.iter_modules(cmd.__path__), key=lambda i: i.name):
        mod = importlib.import_module(f"{cmd.__name__}.{info.name}")
        if hasattr(mod, "run"):
            out[info.name.replace("_", "-")] = (getattr(mod, "HELP", ""), getattr(mod, "add_args", lambda p: None), mod.run)
    return out
