"""Sub-commands of `cflow`: name -> (help, add_arguments, run). Each grows with its stage."""

from __future__ import annotations

import argparse

COMMANDS: dict = {}


def command(name: str, help_: str):
    def wrap(fn):
        COMMANDS[name] = (help_, getattr(fn, "add_args", lambda p: None), fn)
        return fn

    return wrap
