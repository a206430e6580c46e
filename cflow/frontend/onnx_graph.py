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
from ..layout.quant import bf16_to_f32

SHAPE_OPS = ("Shape", "Size")
# Ops folded when all their inputs are constant (the exporter leaves Transpose(weight) unfolded
# when the weight is used twice, as arch5's shared blocks are).
FOLDABLE = ("Identity", "Cast", "Transpose", "Reshape", "Unsqueeze", "Squeeze")


class Node:
    """One node of the graph, as the importer indexes it: its position `k` in graph.node and its fields, read once.

    The importer keys dicts and sets by node. protobuf messages are unhashable, and `id()` of one is unsound as a
    key: protobuf may hand out a fresh Python wrapper for a repeated-field element on each access, and CPython
    reuses the id of a freed wrapper, so an id-keyed index is only right while every wrapper it was built from
    stays alive. A Node is owned by its OnnxModel (hashed by identity, which a dict keyed by it keeps alive) and
    carries `k`, so order and membership never depend on what the process allocated before."""

    __slots__ = ("k", "proto", "name", "op_type", "domain", "input", "output", "attribute")

    def __init__(self, k: int, proto):
        self.k, self.proto = k, proto
        self.name, self.op_type, self.domain = proto.name, proto.op_type, proto.domain
        self.input, self.output = tuple(proto.input), tuple(proto.output)
        self.attribute = tuple(proto.attribute)

    def __repr__(self) -> str:
        return f"Node({self.k}, {self.name!r}, {self.op_type})"


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
        self._check_text()
        self.opset = self._default_opset()
        self.nodes = [Node(k, n) for k, n in enumerate(g.node)]
        self.inits = {}
        for t in g.initializer:
            if t.name in self.inits:
                raise CflowError(f"{where}: initializer {t.name!r} is defined twice")
            self.inits[t.name] = t
        self.inputs = [i for i in g.input if i.name not in self.inits]
        self.outputs = [o.name for o in g.output]
        self.producer: dict[str, Node] = {}
        self.consumers: dict[str, list[Node]] = defaultdict(list)
        defined = set(self.inits) | {i.name for i in self.inputs} | {""}
        # Values that are constants: initializers, Constant nodes and foldable ops of constants. One forward pass
        # (the nodes are checked to be in topological order below), so is_const never recurses.
        self._consts = set(self.inits)
        for n in self.nodes:
            self._check_node(n)
            for v in n.input:
                if not v:
                    continue  # an omitted optional input
                if v not in defined:
                    raise CflowError(f"{where}: {label(n)} reads undefined value {v!r} "
                                     "(file truncated or not topologically sorted)")
                self.consumers[v].append(n)
            for v in n.output:
                if v in defined and v:
                    # One producer per value (ONNX is SSA): a second definition would silently replace the
                    # first in the index and make the patterns read the wrong node.
                    raise CflowError(f"{where}: {label(n)} writes {v!r}, which is already defined")
                self.producer[v] = n
                defined.add(v)
            if n.domain in ("", "ai.onnx") and (n.op_type == "Constant" or (
                    n.op_type in FOLDABLE and all(v in self._consts for v in n.input if v))):
                self._consts.update(v for v in n.output if v)
        for o in self.outputs:
            if o not in defined:
                raise CflowError(f"{where}: graph output {o!r} is never computed (file truncated?)")
        self._const_cache: dict[str, np.ndarray] = {}
        self._check_external()
        self.hidden = self._hidden_values()

    # --- structure -----------------------------------------------------------------------
    def _check_text(self) -> None:
        """Every name, op type and domain is text. protobuf hands a string field that is not valid UTF-8 (a
        corrupt file) back as bytes, which the schema lookup, the dict lookups and the messages cannot use."""
        g = self.graph

        def check(v, what: str) -> None:
            if not isinstance(v, str):
                raise CflowError(f"{self.where}: {what} is not valid UTF-8 text ({bytes(v)[:40]!r}): file corrupt")

        for o in self.proto.opset_import:
            check(o.domain, "an opset_import domain")
        for p in self.proto.metadata_props:
            check(p.key, "a metadata key")
            check(p.value, f"metadata {p.key!r}")
        for t in g.initializer:
            check(t.name, "an initializer name")
            for e in t.external_data:
                check(e.key, f"an external-data key of tensor {t.name!r}")
                check(e.value, f"external-data {e.key!r} of tensor {t.name!r}")
        for v in list(g.input) + list(g.output):
            check(v.name, "a graph input or output name")
        for k, n in enumerate(g.node):
            check(n.name, f"the name of node {k}")
            where = f"node {k} ({n.name!r})"
            check(n.op_type, f"the op type of {where}")
            check(n.domain, f"the domain of {where}")
            for v in list(n.input) + list(n.output):
                check(v, f"a value name of {where}")
            for a in n.attribute:
                check(a.name, f"an attribute name of {where}")

    def _default_opset(self) -> int:
        from onnx import defs

        versions = [o.version for o in self.proto.opset_import if o.domain in ("", "ai.onnx")]
        if not versions:
            raise CflowError(f"{self.where}: no opset for the default ONNX domain in opset_import")
        top = defs.onnx_opset_version()
        if not 1 <= versions[0] <= top:
            raise CflowError(f"{self.where}: opset_import: default-domain opset {versions[0]} is out of range "
                             f"1..{top} (the opsets this onnx package defines)")
        return int(versions[0])

    def _check_node(self, n) -> None:
        """The node has the inputs, outputs and attributes its op's schema requires at the file's opset.

        The pattern code indexes a node's inputs and reads its attributes by what its op_type promises;
        a hand-edited op_type, input list or attribute type is refused here, naming the node, instead of
        failing later as an IndexError or a wrong value."""
        from onnx import AttributeProto, defs

        if n.domain not in ("", "ai.onnx"):
            return  # custom-domain ops match no pattern; check_ops names them
        try:
            s = defs.get_schema(n.op_type, self.opset, "")
        except defs.SchemaError:
            if n.op_type and defs.has(n.op_type):
                raise CflowError(f"{self.where}: {label(n)}: op {n.op_type} does not exist at opset "
                                 f"{self.opset} (the file's default-domain opset)") from None
            return  # not an ONNX op: the pattern matcher names it (with a hint for the ones we know)
        for what, got, lo, hi in (("inputs", len(n.input), s.min_input, s.max_input),
                                  ("outputs", len(n.output), s.min_output, s.max_output)):
            if not lo <= got <= hi:
                want = f"{lo}" if lo == hi else f"{lo}..{hi}" if hi < 2**31 - 1 else f"at least {lo}"
                raise CflowError(f"{self.where}: {label(n)} has {got} {what[:-1] if got == 1 else what}; "
                                 f"{n.op_type} takes {want}")
        for values, formal, what in ((n.input, list(s.inputs), "input"), (n.output, list(s.outputs), "output")):
            for i, v in enumerate(values):
                p = formal[min(i, len(formal) - 1)]
                if not v and p.option != defs.OpSchema.FormalParameterOption.Optional:
                    raise CflowError(f"{self.where}: {label(n)}: {what} {i} ({p.name}) has no name; "
                                     f"it is required")
        given = set()
        for a in n.attribute:
            given.add(a.name)
            sa = s.attributes.get(a.name)
            if sa is not None and a.type != int(sa.type.value):
                got = AttributeProto.AttributeType.Name(a.type) if a.type in AttributeProto.AttributeType.values() \
                    else str(a.type)
                raise CflowError(f"{self.where}: {label(n)}: attribute {a.name!r} is of type {got}; "
                                 f"{n.op_type} expects {sa.type.name}")
        missing = sorted(k for k, sa in s.attributes.items() if sa.required and k not in given)
        if missing:
            raise CflowError(f"{self.where}: {label(n)}: required attribute {missing[0]!r} is missing")

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
        """Value of an initializer, a Constant node or a foldable op of constants, else None."""
        if name in self._const_cache:
            return self._const_cache[name]
        if name not in self._consts:
            return None
        # Evaluate the producers iteratively: a hostile file may chain thousands of Identity nodes.
        vals: dict[str, np.ndarray] = {}
        todo = [name]
        while todo:
            v = todo[-1]
            if v in vals:
                todo.pop()
                continue
            if v in self._const_cache:
                vals[v] = self._const_cache[v]
            elif v in self.inits:
                vals[v] = self._tensor(self.inits[v])
            else:
                n = self.producer[v]
                if n.op_type == "Constant":
                    vals[v] = self._constant_node(n)
                else:
                    need = [u for u in n.input if u and u not in vals]
                    if need:
                        todo.extend(need)
                        continue
                    vals[v] = self._fold(n, [vals[u] if u else None for u in n.input])
            todo.pop()
        for k, v in vals.items():
            if v.size <= 4096:
                self._const_cache[k] = v
        return vals[name]

    def is_const(self, name: str) -> bool:
        return name in self._consts

    def _fold(self, n, ins: list) -> np.ndarray:
        """One foldable op on constant inputs; a hostile attribute or shape is a CflowError naming the node."""
        from onnx import helper

        def bad(what: str) -> CflowError:
            return CflowError(f"{self.where}: {label(n)}: {what}")

        x = ins[0]
        op = n.op_type
        if op == "Identity":
            return x
        if op == "Cast":
            to = self.attr(n, "to")
            try:
                dtype = helper.tensor_dtype_to_np_dtype(to)
                return x.astype(dtype)
            except (KeyError, ValueError, TypeError, OverflowError):
                raise bad(f"attribute 'to' = {to} is not a type {x.dtype} can be cast to") from None
        if op == "Transpose":
            perm = self.attr(n, "perm")
            perm = list(range(x.ndim))[::-1] if perm is None else [int(p) for p in perm]
            if sorted(perm) != list(range(x.ndim)):
                raise bad(f"attribute 'perm' = {perm} is not a permutation of the {x.ndim} axes of "
                          f"{n.input[0]!r} {list(x.shape)}")
            return np.transpose(x, perm)
        if op == "Reshape":
            target = np.asarray(ins[1])
            if target.dtype.kind not in "iu" or target.ndim != 1:
                raise bad(f"input 'shape' {n.input[1]!r} is not a 1-D integer tensor")
            shape = [int(s) for s in target]
            if not self.attr(n, "allowzero", 0):
                if any(s == 0 and i >= x.ndim for i, s in enumerate(shape)):
                    raise bad(f"shape {shape} copies a dimension {n.input[0]!r} {list(x.shape)} does not have")
                shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
            try:
                if min(shape, default=0) < -1 or shape.count(-1) > 1:
                    raise ValueError
                return x.reshape(shape)
            except (ValueError, TypeError, OverflowError):
                raise bad(f"cannot reshape {n.input[0]!r} {list(x.shape)} to {shape}") from None
        axes = ins[1] if len(ins) > 1 and ins[1] is not None else self.attr(n, "axes")
        try:
            axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
        except (ValueError, TypeError, OverflowError):
            raise bad("axes are not integers") from None
        if op == "Unsqueeze":
            if axes is None:
                raise bad("no axes (input or attribute)")
            r = x.ndim + len(axes)
            norm = [a % r for a in axes if -r <= a < r]
            if len(norm) != len(axes) or len(set(norm)) != len(norm):
                raise bad(f"axes {axes} out of range or repeated for a rank-{r} result")
            for a in sorted(norm):
                x = np.expand_dims(x, a)
            return x
        # Squeeze
        if axes is None:
            return np.squeeze(x)
        norm = [a % x.ndim for a in axes if -x.ndim <= a < x.ndim]
        if len(norm) != len(axes) or len(set(norm)) != len(norm) or any(x.shape[a] != 1 for a in norm):
            raise bad(f"axes {axes} do not name distinct size-1 dimensions of {n.input[0]!r} {list(x.shape)}")
        return np.squeeze(x, axis=tuple(norm))

    def const_shape(self, name: str) -> tuple | None:
        if name in self.inits:
            return tuple(self.inits[name].dims)
        v = self.const(name)
        return None if v is None else tuple(v.shape)

    def _tensor(self, t) -> np.ndarray:
        from onnx import TensorProto, helper, numpy_helper

        if t.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
            raw_bf16 = t.data_type == TensorProto.BFLOAT16
            arr = np.memmap(self.base_dir / info["location"], dtype=np.uint16 if raw_bf16 else dtype, mode="r",
                            offset=int(info.get("offset", 0) or 0), shape=tuple(t.dims))
            return bf16_to_f32(arr) if raw_bf16 else arr
        try:
            a = numpy_helper.to_array(t)
        except Exception as e:
            raise CflowError(f"{self.where}: tensor {t.name!r} is malformed ({type(e).__name__}: {e})") from None
        return a.astype(np.float32) if a.dtype.kind == "V" or str(a.dtype) == "bfloat16" else a

    def _constant_node(self, n) -> np.ndarray:
        from onnx import helper, numpy_helper

        for a in n.attribute:
            if a.name == "value":
                try:
                    v = numpy_helper.to_array(a.t)
                except Exception as e:  # noqa: BLE001 -- protobuf/numpy raise many types on a lying tensor
                    raise CflowError(f"{self.where}: {label(n)}: attribute 'value' is malformed "
                                     f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
                return v.astype(np.float32) if v.dtype.kind == "V" or str(v.dtype) == "bfloat16" else v
            if a.name in ("value_float", "value_int", "value_floats", "value_ints"):
                return np.asarray(helper.get_attribute_value(a))
        raise CflowError(f"{self.where}: {label(n)} has no numeric value "
                         "(expected attribute value, value_float(s) or value_int(s))")

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

    @staticmethod
    def order(node: Node) -> int:
        """The node's position in graph.node."""
        return node.k

    def backward_slice(self, outputs, stop: set[str]) -> list:
        """Nodes needed to compute `outputs` from `stop` values, graph inputs and constants, in graph order."""
        seen, todo, out, taken = set(), list(outputs), [], set()
        while todo:
            v = todo.pop()
            if v in stop or v in seen or v in self.inits or not v:
                continue
            seen.add(v)
            n = self.producer.get(v)
            if n is None:
                continue
            if n not in taken:
                taken.add(n)
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
        g = helper.make_graph([n.proto for n in nodes], "slice", ins, outs)
        m = helper.make_model(g, opset_imports=list(self.proto.opset_import), ir_version=self.proto.ir_version)
        ev = ReferenceEvaluator(m)
        return ev.run(None, {k: np.asarray(v) for k, v in all_feeds.items() if k in needed})


