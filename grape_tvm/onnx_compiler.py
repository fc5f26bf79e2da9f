"""Compile an ONNX model: a graph through ``compiler.build``, a graph whose computing node is a
``Loop`` through ``onnx_loop`` (into a ``compile_loop`` module), a decoder sharded over N
devices Megatron's way (``passes.megatron``) into a tensor-parallel module carrying its
weights.

It sits above both: ``compiler`` compiles Relax and knows nothing of ONNX; ``onnx_loop`` takes
a Loop apart and compiles its step with ``compiler.compile_loop``. Neither imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import tvm
from tvm import relax

from grape_tvm.artifact import weight_sections
from grape_tvm.compiler import GrapeModule, build
from grape_tvm.frontend import (import_onnx, initializers_as_inputs, load_onnx, onnx_signature,
                                with_identifier_dims)
from grape_tvm.onnx_loop import compile_onnx_loop, find_loop
from grape_tvm.runtime.tensor_parallel import PLAN_KEY


def compile_onnx(model: Any, dims: Mapping[str, Any] | None = None, target: Any = "llvm", *,
                 tensor_parallel: int = 1, **kwargs) -> GrapeModule:
    """Import an ONNX model (path or ``ModelProto``) and ``build`` it. A graph whose
    computing node is a ``Loop`` becomes a loop module (``grape_tvm.onnx_loop``).
    ``tensor_parallel`` > 1: a decoder sharded over that many devices Megatron's way
    (``compile_megatron``), run with ``grape_tvm.load_tensor_parallel``."""
    proto = load_onnx(model)
    if tensor_parallel != 1:
        return compile_megatron(proto, dims, target, tensor_parallel, **kwargs)
    if find_loop(proto) is not None:
        return compile_onnx_loop(proto, dims, target, **kwargs)
    signature = onnx_signature(proto, dims or {})
    proto, ranges, dim_names = with_identifier_dims(proto, signature.dims)
    mod = import_onnx(proto, ranges)
    return build(mod, ranges, target, signature=signature, dim_names=dim_names, **kwargs)


@dataclass
class WeightCarryingModule(GrapeModule):
    """A tensor-parallel module whose artifact holds its whole weights (``weight/NAME``
    sections, named by ``plan["tensor_parallel"]["weights"]``): ``TensorParallelSession``
    binds each rank's part of them as it loads."""

    weights: dict[str, np.ndarray] = field(default_factory=dict)

    def sections(self) -> dict[str, bytes]:
        return {**super().sections(), **weight_sections(self.weights)}


def compile_megatron(proto: onnx.ModelProto, dims: Mapping[str, Any] | None, target: Any,
                     world_size: int, **kwargs) -> WeightCarryingModule:
    """An ONNX decoder compiled for ``world_size`` devices, Megatron's way: its weights (the
    initializers of floating point) made inputs, ``main`` annotated by ``ShardMegatron``
    and lowered to each rank's program (``build(tensor_parallel=...)``). The module carries
    the whole weights, a fused qkv weight's and bias's columns already in rank order
    (``columns_by_ranks``, named in ``plan["tensor_parallel"]["columns_by_ranks"]``), for
    the session to split; its signature is a rank's (its weights' shapes a rank's part)."""
    from grape_tvm.passes.megatron import (  # pylint: disable=import-outside-toplevel
        COLUMNS_BY_RANKS_ATTR, InputForVarlessCalls, ShardMegatron, columns_by_ranks)

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"tensor_parallel must be a number of devices (1: no sharding), "
                         f"got {world_size!r}")
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer
               if i.dims and np.issubdtype(onnx.helper.tensor_dtype_to_np_dtype(i.data_type),
                                           np.floating)}
    proto = initializers_as_inputs(proto, list(weights))
    signature = onnx_signature(proto, dims or {})
    proto, ranges, dim_names = with_identifier_dims(proto, signature.dims)
    mod = import_onnx(proto, ranges)
    # main's parameters are the graph's inputs in order, under the importer's identifiers
    # ("h.0.weight" -> "h_0_weight"): the weights by the names a rank's program takes.
    ir_names = dict(zip((v.name for v in proto.graph.input),
                        (p.name for p in mod["main"].params)))
    mod = tvm.transform.Sequential([
        # shape_of a weight folded to its shape: PropagateSharding has no rule for shape_of
        relax.transform.CanonicalizeBindings(), relax.transform.FoldConstant(),
        relax.transform.DeadCodeElimination(["main"]),
        InputForVarlessCalls(), ShardMegatron(world_size)])(mod)
    reordered = {str(k): int(v) for k, v in mod["main"].attrs[COLUMNS_BY_RANKS_ATTR].items()}
    mod["main"] = mod["main"].without_attr(COLUMNS_BY_RANKS_ATTR)
    whole = {ir_names[name]: value for name, value in weights.items()}
    for name, parts in reordered.items():
        whole[name] = columns_by_ranks(whole[name], parts, world_size)
    module = build(mod, ranges, target, output_names=[o.name for o in proto.graph.output],
                   dim_names=dim_names, tensor_parallel=world_size, **kwargs)
    module.plan[PLAN_KEY].update(weights=sorted(whole), columns_by_ranks=reordered)
    return WeightCarryingModule(**{f.name: getattr(module, f.name) for f in fields(module)},
                                weights=whole)
