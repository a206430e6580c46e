"""Frontends: PyTorch modules, checkpoint directories, presets (and ONNX files) -> IR Graph."""

from .torch_module import from_torch


def from_onnx(path_or_proto, name=None, **kwargs):
    """An ONNX decoder graph (path or ModelProto) -> verified Graph (see onnx_import.from_onnx)."""
    from .onnx_import import from_onnx as _from_onnx

    return _from_onnx(path_or_proto, name=name, **kwargs)


__all__ = ["from_torch", "from_onnx"]
