"""Every user-facing failure in cflow is one of these: a short message naming the thing at fault.

The CLI prints ``error: <message>`` on one line and exits non-zero; tracebacks only with --debug.
"""


class CflowError(Exception):
    """Base class: a clear, one-line, user-facing error."""


class ConfigError(CflowError, ValueError):
    """A model configuration field is out of its allowed range."""


class VerifyError(CflowError):
    """The IR is malformed (names the node)."""


class PassError(CflowError):
    """A pass failed (names the pass and the passes that ran before it)."""


class UnsupportedModelError(CflowError):
    """The model uses a feature or op the IR does not model (names the node or module path)."""


class FormatError(CflowError):
    """A .vflow/.cflow file is corrupt, truncated or inconsistent (names section and offset)."""


class CodegenError(CflowError):
    """Code generation or the JIT failed, or the host lacks a required CPU feature."""


class RuntimeFault(CflowError):
    """A run-time failure: prompt longer than the context, expert-tier I/O error, ..."""
