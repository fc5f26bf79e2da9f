"""Compile an ONNX model: a graph through ``compiler.build``, a graph whose computing node is a
``Loop`` through ``onnx_loop`` (into a ``compile_loop`` module).

It sits above both: ``compiler`` compiles Relax and knows nothing of ONNX; ``onnx_loop`` takes
a Loop apart and compiles its step with ``compiler.compile_loop``. Neither imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grape_tvm.compiler import GrapeModule, build
from grape_tvm.frontend import import_onnx, load_onnx, onnx_signature, with_identifier_dims
from grape_tvm.onnx_loop import compile_onnx_loop, find_loop


def compile_onnx(model: Any, dims: Mapping[str, Any] | None = None, target: Any = "llvm",
                 **kwargs) -> GrapeModule:
    """Import an ONNX model (path or ``ModelProto``) and ``build`` it. A graph whose
    computing node is a ``Loop`` becomes a loop module (``grape_tvm.onnx_loop``)."""
    proto = load_onnx(model)
    if find_loop(proto) is not None:
        return compile_onnx_loop(proto, dims, target, **kwargs)
    signature = onnx_signature(proto, dims or {})
    proto, ranges, dim_names = with_identifier_dims(proto, signature.dims)
    mod = import_onnx(proto, ranges)
    return build(mod, ranges, target, signature=signature, dim_names=dim_names, **kwargs)
