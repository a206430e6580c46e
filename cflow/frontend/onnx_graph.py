"""ONNX file access for the importer: safe loading (external data included), an index of producers,
consumers and constants, the hidden/positional split of values, and evaluation of sub-graphs.

Values split in two: *hidden* ones depend on the token ids' values (the embedding and everything
downstream), the others are constants or depend only on the sequence length (causal mask, RoPE
tables, reshape targets). Shape/Size outputs are never hidden.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..errors import CflowError

SHAPE_OPS = ("Shape", "Size")
# Ops folded when all their inputs are constant (the exporter leaves Transpose(weight) unfolded
# when the weight is used twice, as arch5's shared blocks are).
FOLDABLE = ("Identity", "Cast", "Transpose", "Reshape", "Unsqueeze", "Squeeze")


def label(node) -> str:
    """How errors name an ONNX node: its name and op_type."""
    return f"node {node.name or '<unnamed>'!r} ({node.op_type})"


def load_model_proto(path_or_proto):
    """(ModelProto, base directory or None, display name). One-line CflowError on anything not ONNX."""
    import onnx
    from google.protobuf.message import DecodeError

    if hasattr(path_or_proto, "graph") and hasattr(path_or_proto, "opset_import"):
        return path_or_proto, None, "<ModelProto>"
    p = Path(path_or_proto)
    if not p.is_file():
        raise CflowError(f"{p}: no such ONNX file")
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CflowError(f"{p}: not an ONNX model or truncated ({msg})") from None
    except Exception as e:  # protobuf variants raise their own types
        raise CflowError(f"{p}: not an ONNX model or truncated ({type(e).__name__})") from None
    return proto, p.parent, str(p)


class OnnxModel:
    """Index of one ONNX graph: nodes in order, who produces and who consumes each value, constants."""

    def __init__(self, proto, base_dir: Path | None, where: str):
        self.proto, self.base_dir, self.where = proto, base_dir, where
        g = proto.graph
        if not proto.opset_import or not len(g.node):
            raise CflowError(f"{where}: not an ONNX model or truncated (no graph nodes)")
        self.graph = g
        self.nodes = list(g.node)
        self.inits = {t.name: t for t in g.initializer}
        self.inputs = [i for i in g.input if i.name not in self.inits]
        self.outputs = [o.name for o in g.output]
        self.producer: dict[str, object] = {}
        self.consumers: dict[str, list] = defaultdict(list)
        self.index = {}
        defined = set(self.inits) | {i.name for i in self.inputs} | {""}
        for k, n in enumerate(self.nodes):
            for v in n.input:
                if not v:
                    continue  # an omitted optional input
                if v not in defined:
                    raise CflowError(f"{where}: {label(n)} reads undefined value {v!r} "
                                     "(file truncated or not topologically sorted)")
                self.consumers[v].append(n)
            for v in n.output:
                self.producer[v] = n
                defined.add(v)
            self.index[id(n)] = k
        for o in self.outputs:
            if o not in defined:
                raise CflowError(f"{where}: graph output {o!r} is never computed (file truncated?)")
        self._const_cache: dict[str, np.ndarray] = {}
        self._check_external()
        self.hidden = self._hidden_values()

    # --- constants ---------------------------------------------------------------------
    def _check_external(self) -> None:
        """Every external tensor's file exists, stays inside the model's directory and is long enough."""
        from onnx import TensorProto

        for t in self.inits.values():
            if t.data_location != TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            loc = info.get("location", "")
            if self.base_dir is None:
                raise CflowError(
                    f"{self.where}: tensor {t.name!r} has external data; pass the .onnx path, not a ModelProto")
            f = (self.base_dir / loc).resolve()
            if not loc or os.path.isabs(loc) or self.base_dir.resolve() not in f.parents:
                raise CflowError(f"{self.where}: tensor {t.name!r}: "
                                 f"external data location {loc!r} is outside the model's directory")
            if not f.is_file():
                raise CflowError(f"{self.where}: external data file {loc!r} (tensor {t.name!r}) is missing")
            if any(d < 0 for d in t.dims):
                raise CflowError(f"{self.where}: tensor {t.name!r} has a negative dimension {list(t.dims)}")
            offset, nbytes = int(info.get("offset", 0) or 0), self._nbytes(t)
            if info.get("length") and int(info["length"]) != nbytes:
                raise CflowError(f"{self.where}: tensor {t.name!r}: external length {info['length']} does not match "
                                 f"its shape {list(t.dims)} ({nbytes} bytes)")
            need = offset + nbytes
            if offset < 0 or f.stat().st_size < need:
                raise CflowError(f"{self.where}: external data file {loc!r} is truncated "
                                 f"(tensor {t.name!r} needs bytes up to {need}, file has {f.stat().st_size})")

    @staticmethod
    def _nbytes(t) -> int:
        """Bytes of a tensor from its dims, in Python integers (no overflow on lying shapes)."""
        from onnx import helper

        try:
            item = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        except Exception:
            raise CflowError(f"tensor {t.name!r} has unsupported data type {t.data_type}") from None
        return math.prod(int(d) for d in t.dims) * item

    def const(self, name: str) -> np.ndarray | None:
        """Value of an initializer or Constant node (through Identity), else None."""
        if name in self._const_cache:
            return self._const_cache[name]
        v = None
        if name in self.inits:
            v = self._tensor(self.inits[name])
        else:
            n = self.producer.get(name)
            if n is not None and n.op_type == "Constant":
                v = self._constant_node(n)
            elif n is not None and n.op_type in FOLDABLE and self.is_const(n.input[0]):
                v = self._fold(n)
        if v is not None and v.size <= 4096:
            self._const_cache[name] = v
        return v

    def is_const(self, name: str) -> bool:
        if name in self.inits:
            return True
        n = self.producer.get(name)
        return n is not None and (n.op_type == "Constant" or (
            n.op_type in FOLDABLE and all(self.is_const(v) for v in n.input if v)))

    def _fold(self, n) -> np.ndarray:
        from onnx import helper

        x = self.const(n.input[0])
        op = n.op_type
        if op == "Identity":
            return x
        if op == "Cast":
            return x.astype(helper.tensor_dtype_to_np_dtype(self.attr(n, "to")))
        if op == "Transpose":
            return np.transpose(x, self.attr(n, "perm") or None)
        if op == "Reshape":
            shape = [int(s) for s in self.const(n.input[1]).reshape(-1)]
            if not self.attr(n, "allowzero", 0):
                shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
            return x.reshape(shape)
        axes = self.const(n.input[1]) if len(n.input) > 1 and n.input[1] else self.attr(n, "axes")
        axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
        if op == "Unsqueeze":
            for a in sorted(a % (x.ndim + len(axes)) for a in axes):
                x = np.expand_dims(x, a)
            return x
        return np.squeeze(x, axis=None if axes is None else tuple(axes))

    def const_shape(self, name: str) -> tuple | None:
        if name in self.inits:
            return tuple(self.inits[name].dims)
        v = self.const(name) if self.is_const(name) else None
        return None if v is None else tuple(v.shape)

    def _tensor(self, t) -> np.ndarray:
        from onnx import TensorProto, helper, numpy_helper

        if t.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
            raw_bf16 = t.data_type == TensorProto.BFLOAT16
            arr = np.memmap(self.base_dir / info["location"], dtype=np.uint16 if raw_bf16 else dtype, mode="r",
                            offset=int(info.get("offset", 0) or 0), shape=tuple(t.dims))
            return _bf16_to_f32(arr) if raw_bf16 else arr
        try:
            a = numpy_helper.to_array(t)
        except Exception as e:
            raise CflowError(f"{self.where}: tensor {t.name!r} is malformed ({type(e).__name__}: {e})") from None
        return a.astype(np.float32) if a.dtype.kind == "V" or str(a.dtype) == "bfloat16" else a

    def _constant_node(self, n) -> np.ndarray | None:
        from onnx import helper, numpy_helper

        for a in n.attribute:
            if a.name == "value":
                return numpy_helper.to_array(a.t)
            if a.name in ("value_float", "value_int", "value_floats", "value_ints"):
                return np.asarray(helper.get_attribute_value(a))
        return None

    def attr(self, node, name: str, default=None):
        from onnx import helper

        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    # --- graph queries -----------------------------------------------------------------
    def _hidden_values(self) -> set[str]:
        hidden = {i.name for i in self.inputs}
        for n in self.nodes:
            if n.op_type not in SHAPE_OPS and any(v in hidden for v in n.input):
                hidden.update(o for o in n.output if o)
        return hidden

    def users(self, value: str) -> list:
        return self.consumers.get(value, [])

    def order(self, node) -> int:
        return self.index[id(node)]

    def backward_slice(self, outputs, stop: set[str]) -> list:
        """Nodes needed to compute `outputs` from `stop` values, graph inputs and constants, in graph order."""
        seen, todo, out, ids = set(), list(outputs), [], set()
        while todo:
            v = todo.pop()
            if v in stop or v in seen or v in self.inits or not v:
                continue
            seen.add(v)
            n = self.producer.get(v)
            if n is None:
                continue
            if id(n) not in ids:
                ids.add(id(n))
                out.append(n)
                todo.extend(n.input)
        return sorted(out, key=self.order)

    def evaluate(self, outputs: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run the slice of the graph computing `outputs` from `feeds` (+ input_ids etc.) with onnx.reference."""
        from onnx import helper
        from onnx.reference import ReferenceEvaluator

        nodes = self.backward_slice(outputs, set(feeds))
        needed = {v for n in nodes for v in n.input if v} | set(outputs)
        consts = {v: self.const(v) for v in needed if v in self.inits}
        all_feeds = {**feeds, **consts}
        for i in self.inputs:
            if i.name in needed and i.name not in all_feeds:
                raise CflowError(f"{self.where}: evaluation needs graph input {i.name!r}")
        ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype), None)
               for k, v in all_feeds.items() if k in needed]
        outs = [helper.make_tensor_value_info(o, 0, None) for o in outputs]
        g = helper.make_graph(nodes, "slice", ins, outs)
        m = helper.make_model(g, opset_imports=list(self.proto.opset_import), ir_version=self.proto.ir_version)
        ev = ReferenceEvaluator(m)
        return ev.run(None, {k: np.asarray(v) for k, v in all_feeds.items() if k in needed})


def _bf16_to_f32(a: np.ndarray) -> np.ndarray:
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
