"""ONNX to Relax with symbolic dimensions, and the signature users call the model with."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import tvm
from tvm import relax

from grape_tvm.onnx_fixes import CONVERTERS, UnsupportedNode, default_opset, from_onnx, subgraphs
from grape_tvm.onnx_functions import functions_expanded
from grape_tvm.runtime.signature import ShapeRange, Signature, TensorSpec

_ONNX_DTYPES = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float64", onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT16: "int16", onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT64: "uint64", onnx.TensorProto.UINT32: "uint32",
    onnx.TensorProto.UINT16: "uint16", onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.FLOAT8E4M3FN: "float8_e4m3fn", onnx.TensorProto.FLOAT8E5M2: "float8_e5m2",
    onnx.TensorProto.FLOAT8E8M0: "float8_e8m0fnu",
}


class ImportError_(RuntimeError):
    """TVM's ONNX importer could not import the model, or grape refused a node of it."""


def load_onnx(model: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    """An ONNX model from a file (or as given), refused naming it when it is not one that
    grape can import: empty, without a graph, or of an opset newer than onnx here knows."""
    if isinstance(model, onnx.ModelProto):
        _check_model(model, f"ONNX graph {model.graph.name!r}")
        return model
    path = Path(model)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder, expected an ONNX file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such ONNX file")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty, not an ONNX model")
    try:
        proto = onnx.load(str(path))
    except Exception as err:  # pylint: disable=broad-except
        raise ValueError(f"{path} is not a readable ONNX model: {err}") from None
    _check_model(proto, str(path))
    return proto


def _check_model(model: onnx.ModelProto, name: str) -> None:
    if not model.HasField("graph"):
        raise ValueError(f"{name} is not an ONNX model: it has no graph")
    # As onnxruntime: operators of a newer opset may have changed in ways no converter knows.
    opset, newest = default_opset(model), onnx.defs.onnx_opset_version()
    if opset > newest:
        raise ValueError(f"{name} uses ONNX opset {opset} (domain ai.onnx); the installed onnx "
                         f"{onnx.__version__} knows opsets up to {newest}: export the model "
                         f"with opset {newest} or older")


def _tensor_type(value: onnx.ValueInfoProto, output: bool):
    """The tensor type of a value: its own, an optional's, or (outputs) a sequence's."""
    kind = value.type.WhichOneof("value")
    if kind == "tensor_type":
        return value.type.tensor_type, False
    if kind == "optional_type" and value.type.optional_type.elem_type.HasField("tensor_type"):
        return value.type.optional_type.elem_type.tensor_type, False
    if output and kind == "sequence_type" and \
            value.type.sequence_type.elem_type.HasField("tensor_type"):
        return value.type.sequence_type.elem_type.tensor_type, True
    raise ValueError(f"ONNX value {value.name!r} is of {kind or 'no'} type: grape-tvm takes "
                     "tensors (or optional tensors) and returns tensors or sequences of them")


def _value_spec(value: onnx.ValueInfoProto, output: bool = False) -> TensorSpec:
    """An input's or output's name, dtype and shape; an output's unnamed axis (a size that
    depends on the data, as Unique's) is "?": outputs are not checked against ranges. A
    sequence output is of kind "sequence": its tensors come back as a list."""
    ttype, sequence = _tensor_type(value, output)
    if not output and not ttype.HasField("shape"):
        raise ValueError(f"ONNX input {value.name!r} has no shape (its rank is unknown): "
                         "grape-tvm needs every input's rank; give it a shape, with dim_param "
                         "names for the sizes that vary")
    dtype = _ONNX_DTYPES.get(ttype.elem_type)
    if dtype is None:
        raise ValueError(f"ONNX value {value.name!r} has element type "
                         f"{onnx.TensorProto.DataType.Name(ttype.elem_type)}, not supported")
    if sequence:
        return TensorSpec(value.name, dtype, (), kind="sequence")
    shape = []
    for axis, dim in enumerate(ttype.shape.dim):
        if dim.HasField("dim_value"):
            shape.append(int(dim.dim_value))
        elif dim.HasField("dim_param"):
            shape.append(dim.dim_param)
        elif output:
            shape.append("?")
        else:
            raise ValueError(f"ONNX value {value.name!r} axis {axis} has neither a size nor a "
                             "dim_param name: name it so that a range can be declared")
    return TensorSpec(value.name, dtype, tuple(shape))


def onnx_signature(model: onnx.ModelProto, dims: Mapping[str, Any]) -> Signature:
    """Inputs and outputs of an ONNX graph, with every symbolic dim's declared range."""
    initializers = {i.name for i in model.graph.initializer}
    inputs = tuple(_value_spec(v) for v in model.graph.input if v.name not in initializers)
    outputs = tuple(_value_spec(v, output=True) for v in model.graph.output)
    ranges = {name: ShapeRange.of(r, name) for name, r in dims.items()}
    named = {d for t in inputs for d in t.shape if isinstance(d, str)}
    for spec in inputs:
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, str) and dim not in ranges:
                raise ValueError(f"dimension {dim!r} of input {spec.name!r} (axis {axis}) has "
                                 f"no declared range: pass --dim {dim}=LO:HI "
                                 f"(dims={{'{dim}': (lo, hi)}} from Python)")
    unknown = sorted(set(ranges) - named)
    if unknown:
        raise ValueError(f"declared dimension(s) {unknown} are not dim_param names of any "
                         f"input; the inputs name {sorted(named) or 'none'}")
    return Signature(inputs, outputs, ranges)


_CONSTANT_VALUES = {  # Constant's typed value attributes, as a tensor (dtype, 0-d or 1-d)
    "value_float": (np.float32, 0), "value_floats": (np.float32, 1),
    "value_int": (np.int64, 0), "value_ints": (np.int64, 1),
}


def _constant_as_tensor(node: onnx.NodeProto) -> None:
    for attr in list(node.attribute):
        if attr.name in _CONSTANT_VALUES and not attr.ref_attr_name:
            dtype, rank = _CONSTANT_VALUES[attr.name]
            value = onnx.helper.get_attribute_value(attr)
            array = np.array(value, dtype=dtype).reshape(-1 if rank else ())
            node.attribute.remove(attr)
            node.attribute.append(onnx.helper.make_attribute(
                "value", onnx.numpy_helper.from_array(array, node.output[0])))
            return


def normalize_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant nodes given as ``value_float(s)``/``value_int(s)`` rewritten to ``value``.

    TVM 0.27's importer reads only ``value`` ("no value in Constant"): the ONNX function
    expansions of Celu, Elu, Selu, LeakyRelu, HardSigmoid, Swish, the window functions and
    others use the typed forms. Works on a copy, subgraphs included.
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for graph in subgraphs(model.graph):
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                _constant_as_tensor(node)
    return model


def _dim_params(model: onnx.ModelProto):
    """Every named axis of every value of the model, subgraphs included."""
    for graph in subgraphs(model.graph):
        for value in (*graph.input, *graph.output, *graph.value_info):
            for tensor in _tensor_types(value.type):
                yield from (d for d in tensor.shape.dim if d.HasField("dim_param"))


def _tensor_types(value_type: onnx.TypeProto):
    kind = value_type.WhichOneof("value")
    if kind == "tensor_type":
        yield value_type.tensor_type
    elif kind in ("optional_type", "sequence_type"):
        yield from _tensor_types(getattr(value_type, kind).elem_type)


def with_identifier_dims(model: onnx.ModelProto, dims: Mapping[str, ShapeRange]
                         ) -> tuple[onnx.ModelProto, dict[str, ShapeRange], dict[str, str]]:
    """``model`` with every dim_param that is not an identifier renamed to one (on a copy),
    the declared ``dims`` under those names, and the model's name of each renamed one.

    TVM's importer reads a dim_param as an expression ("batch-size" is batch - size, "batch
    size" is batchsize): no range declared under the model's name would reach it. The
    signature keeps the model's names; only the IR sees the identifiers.
    """
    taken = {d.dim_param for d in _dim_params(model)}
    renamed: dict[str, str] = {}
    for name in sorted(taken):
        if not name.isidentifier():
            renamed[name] = _fresh_identifier(name, taken)
            taken.add(renamed[name])
    if renamed:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        for dim in _dim_params(model):
            dim.dim_param = renamed.get(dim.dim_param, dim.dim_param)
    ranges = {renamed.get(name, name): r for name, r in dims.items()}
    return model, ranges, {ir: name for name, ir in renamed.items()}


def _fresh_identifier(name: str, taken: set[str]) -> str:
    base = re.sub(r"\W", "_", name)
    base = base if base[:1].isalpha() or base[:1] == "_" else f"dim_{base}"
    candidate, k = base, 1
    while candidate in taken:
        candidate, k = f"{base}_{k}", k + 1
    return candidate


def initializers_as_inputs(model: onnx.ModelProto, names: Collection[str]) -> onnx.ModelProto:
    """The named initializers (weights) moved to graph inputs, on a copy.

    The compiled artifact then holds no weights: they are passed at run time, once, with
    ``GraphExecutor.bind_inputs``. Shape constants should stay initializers (leave them
    out of ``names``): TVM's converters read their values while importing.
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    wanted = set(names)
    inits = {i.name: i for i in model.graph.initializer}
    missing = sorted(wanted - set(inits))
    if missing:
        raise ValueError(f"no initializer named {missing[:5]} in graph {model.graph.name!r}")
    kept = [i for i in model.graph.initializer if i.name not in wanted]
    lifted = [inits[n] for n in inits if n in wanted]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    listed = {v.name for v in model.graph.input}
    model.graph.input.extend(
        onnx.helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
        for i in lifted if i.name not in listed)
    return model


def import_onnx(model: onnx.ModelProto,
                dims: Mapping[str, ShapeRange | tuple[int, int]] | None = None) -> tvm.IRModule:
    """TVM's Relax ONNX importer, with its failures turned into one clear error.

    grape's own fixes to the ONNX it is given run first: operators TVM lacks expanded into
    their standard function bodies (``functions_expanded``), constants normalized
    (``normalize_constants``); then grape's converters replace TVM's where TVM's fail
    (``grape_tvm.onnx_fixes``); docs/tvm_onnx_frontend.md lists them, upstream-style.
    ``dims``, the declared ranges, let those converters prove slices and ranges in bounds.
    """
    try:
        model = functions_expanded(model, default_opset(model), frozenset(CONVERTERS))
        model = normalize_constants(model)
        ranges = {k: (ShapeRange.of(v, k).lo, ShapeRange.of(v, k).hi) for k, v in (dims or {}).items()}
        mod = from_onnx(model, ranges)
    except Exception as err:  # pylint: disable=broad-except
        first = str(err).strip().splitlines()
        who = "grape-tvm refuses" if isinstance(err, UnsupportedNode) else \
            "TVM's ONNX importer cannot import"
        raise ImportError_(f"{who} graph {model.graph.name!r}: "
                           f"{first[-1] if first else type(err).__name__}") from err
    return relax.transform.DeadCodeElimination(["main"])(mod)
