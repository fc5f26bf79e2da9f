"""ONNX ``Loop`` as a grape loop: one CUDA graph with a WHILE node on a GPU.

TVM 0.27's ONNX importer rejects ``Loop`` (``OpNotImplemented``). grape imports a graph whose
computing node is one ``Loop`` (fed by graph inputs, initializers, ``Constant`` and
``Identity`` nodes) as a ``compile_loop`` step::

    ONNX:  Loop(M, cond, v...)  body(iter_num, cond_in, v_in...) -> (cond_out, v_out...)
    grape: main(grape_loop_iter, grape_loop_cond, grape_carried_k..., grape_invariant_j...)
             -> (iter + 1, cond_out, v_out..., grape_stop = not cond_out)

The body is cut out as its own ONNX graph (its inputs renamed through ``Identity`` nodes, the
values it reads from the outer scope added as initializers, for constants, or as inputs, for
graph inputs: loop invariants, bound once per run) and imported with grape's importer. At run
time the host knows ``M`` and the initial ``cond``: if ``M == 0`` or ``cond`` is false the
initial values are the outputs and nothing runs; else the loop runs at most ``M`` steps
(without ``M``: at most ``max_steps``, the declared limit) and stops after the first step
whose ``cond_out`` is false. Like onnxruntime and onnx's reference implementation, ``cond_out``
is read even when the ``Loop`` has no ``cond`` input.

    m = grape_tvm.compile_onnx("loop.onnx", dims={"n": (1, 64)}, target="cuda")
    m.export("loop.grape")
    with grape_tvm.load_onnx_loop("loop.grape", "cuda") as loop:
        outputs = loop.run({"M": np.array(100), "x": x})    # named as the graph's outputs
        loop.steps                                            # steps the last run took

Not supported (a clear error names the node): scan outputs, carried values whose shape or
dtype changes from step to step, a ``Loop`` (or ``Scan``) inside the body, and graphs with
other computing nodes around the ``Loop``.

This module is the compile side (it needs onnx); running the artifact is
``grape_tvm.runtime.onnx_loop``'s, which a deployment host without onnx can import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import helper
from tvm import relax
from tvm_ffi.structural import structural_equal

from grape_tvm.compiler import GrapeModule, compile_loop
from grape_tvm.frontend import (import_onnx, load_onnx, normalize_constants, onnx_signature,
                                with_identifier_dims)
from grape_tvm.runtime.onnx_loop import COND, ITER, STOP, from_npy_text, npy_text

DEFAULT_MAX_STEPS = 4096  # the step limit of a Loop without a trip count M
_PASSIVE = ("Constant", "Identity")
_NESTED = ("Loop", "Scan")


class OnnxLoopError(ValueError):
    """The ONNX ``Loop`` is of a form grape cannot run as a loop; names the node."""


def find_loop(model: onnx.ModelProto) -> onnx.NodeProto | None:
    """The graph's top-level ``Loop`` node, if it has one."""
    return next((n for n in model.graph.node if n.op_type == "Loop"
                 and n.domain in ("", "ai.onnx")), None)


def _node_name(node: onnx.NodeProto) -> str:
    return node.name or (node.output[0] if node.output else node.op_type)


# -- analysis of the outer graph ---------------------------------------------------------

@dataclass
class _Outer:
    """Where each outer value comes from: a graph input, a constant, or a Loop output."""

    inputs: dict[str, onnx.ValueInfoProto]
    constants: dict[str, np.ndarray]
    alias: dict[str, str]  # Identity outputs -> their input
    loop_outputs: dict[str, int]

    def resolve(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
        return name

    def source(self, name: str) -> dict | None:
        """``{"input": name}``, ``{"const": npy}``, ``{"loop_output": k}`` or None."""
        name = self.resolve(name)
        if name in self.inputs:
            return {"input": name}
        if name in self.constants:
            return {"const": npy_text(self.constants[name])}
        if name in self.loop_outputs:
            return {"loop_output": self.loop_outputs[name]}
        return None


def _outer(model: onnx.ModelProto, loop: onnx.NodeProto) -> _Outer:
    graph = model.graph
    constants = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    inputs = {v.name: v for v in graph.input if v.name not in constants}
    loops = [n for n in graph.node if n.op_type == "Loop"]
    if len(loops) > 1:
        raise OnnxLoopError(f"the graph has {len(loops)} Loop nodes "
                            f"{[_node_name(n) for n in loops]}: grape imports one")
    alias: dict[str, str] = {}
    for node in graph.node:
        if node is loop:
            continue
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            attr = next((a for a in node.attribute if a.name == "value"), None)
            if attr is None:
                raise OnnxLoopError(f"Constant node {_node_name(node)!r} feeding Loop node "
                                    f"{_node_name(loop)!r} has no tensor value "
                                    f"({[a.name for a in node.attribute]})")
            constants[node.output[0]] = onnx.numpy_helper.to_array(attr.t)
        elif node.op_type == "Identity" and node.domain in ("", "ai.onnx"):
            alias[node.output[0]] = node.input[0]
        else:
            raise OnnxLoopError(
                f"node {_node_name(node)!r} ({node.op_type}) is next to Loop node "
                f"{_node_name(loop)!r}: grape imports a graph whose only computing node is "
                f"the Loop (fed by inputs, initializers, {' and '.join(_PASSIVE)} nodes)")
    return _Outer(inputs, constants, alias,
                  {name: k for k, name in enumerate(loop.output) if name})


# -- the step graph ----------------------------------------------------------------------

def _subgraphs(node: onnx.NodeProto):
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        yield from attr.graphs


def _check_body(graph: onnx.GraphProto, loop: onnx.NodeProto) -> None:
    for node in graph.node:
        if node.op_type in _NESTED:
            raise OnnxLoopError(f"Loop node {_node_name(loop)!r}: its body holds {node.op_type} "
                                f"node {_node_name(node)!r}; nested loops are not supported")
        for sub in _subgraphs(node):
            _check_body(sub, loop)


def _free_names(graph: onnx.GraphProto, bound: set[str] | None = None) -> list[str]:
    """Names a graph (its subgraphs included) reads but does not define: the outer scope's."""
    bound = set(bound or ()) | {v.name for v in graph.input} | {i.name for i in graph.initializer}
    free: list[str] = []

    def need(name: str) -> None:
        if name and name not in bound and name not in free:
            free.append(name)

    for node in graph.node:
        for name in node.input:
            need(name)
        for sub in _subgraphs(node):
            for name in _free_names(sub, bound):
                need(name)
        bound.update(node.output)
    for value in graph.output:
        need(value.name)
    return free


def _tensor_info(name: str, value: onnx.ValueInfoProto | np.ndarray) -> onnx.ValueInfoProto:
    if isinstance(value, np.ndarray):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                             list(value.shape))
    info = onnx.ValueInfoProto()
    info.CopyFrom(value)
    info.name = name
    return info


def carried_name(k: int) -> str:
    return f"grape_carried_{k}"


def _invariant_name(j: int) -> str:
    return f"grape_invariant_{j}"


@dataclass
class LoopModel:
    """An ONNX Loop graph taken apart: the step as an ONNX model, and how to run it."""

    node: str
    step: onnx.ModelProto
    trip_count: dict | None  # a source (see _Outer.source), or None when M is absent
    cond: dict | None
    carried: list[dict]  # per carried value: {"state", "body_output", "init": source}
    invariants: dict[str, str]  # step input -> outer graph input
    outputs: list[dict]  # per graph output: {"name", "source"}

    def to_json(self) -> dict:
        return {"node": self.node, "trip_count": self.trip_count, "cond": self.cond,
                "carried": self.carried, "invariants": self.invariants, "outputs": self.outputs}


def split_loop(model: onnx.ModelProto) -> LoopModel:
    """The graph's Loop node as a step model (see the module docstring)."""
    loop = find_loop(model)
    if loop is None:
        raise OnnxLoopError(f"graph {model.graph.name!r} has no Loop node")
    name = _node_name(loop)
    outer = _outer(model, loop)
    body = next(a.g for a in loop.attribute if a.name == "body")
    n_carried = len(loop.input) - 2
    if n_carried < 0 or len(body.input) != 2 + n_carried:
        raise OnnxLoopError(f"Loop node {name!r}: its body takes {len(body.input)} inputs for "
                            f"{max(n_carried, 0)} carried values (expected 2 + carried)")
    scans = len(body.output) - 1 - n_carried
    if scans:
        raise OnnxLoopError(f"Loop node {name!r} has {scans} scan output(s) "
                            f"{[v.name for v in body.output[1 + n_carried:]]}: grape's loops "
                            "keep a fixed-shape state and support no scan outputs")
    _check_body(body, loop)

    def source(value: str, what: str) -> dict | None:
        if not value:
            return None
        src = outer.source(value)
        if src is None or "loop_output" in src:
            raise OnnxLoopError(f"Loop node {name!r}: its {what} {value!r} is computed by a "
                                f"node; grape takes graph inputs, initializers and Constants")
        return src

    trip_count, cond = source(loop.input[0], "trip count M"), source(loop.input[1], "cond")
    inits = [source(v, f"initial value #{k}") for k, v in enumerate(loop.input[2:])]
    if any(s is None for s in inits):
        raise OnnxLoopError(f"Loop node {name!r}: every carried value needs an initial value")

    inputs = [helper.make_tensor_value_info(ITER, onnx.TensorProto.INT64, []),
              helper.make_tensor_value_info(COND, onnx.TensorProto.BOOL, [])]
    nodes = [helper.make_node("Identity", [ITER], [body.input[0].name]),
             helper.make_node("Identity", [COND], [body.input[1].name])]
    carried = []
    for k, (init, value) in enumerate(zip(inits, loop.input[2:])):
        typed = outer.inputs[init["input"]] if "input" in init else from_npy_text(init["const"])
        inputs.append(_tensor_info(carried_name(k), typed))
        nodes.append(helper.make_node("Identity", [carried_name(k)], [body.input[2 + k].name]))
        carried.append({"state": carried_name(k), "body_output": body.output[1 + k].name,
                        "init": init, "outer": value})
    initializers = list(body.initializer)
    invariants: dict[str, str] = {}
    for free in _free_names(body):
        src = outer.source(free)
        if src is None or "loop_output" in src:
            raise OnnxLoopError(f"Loop node {name!r}: its body reads {free!r}, which is not a "
                                "graph input, initializer or Constant of the outer graph")
        if "const" in src:
            initializers.append(onnx.numpy_helper.from_array(from_npy_text(src["const"]), free))
        else:
            step_name = _invariant_name(len(invariants))
            invariants[step_name] = src["input"]
            inputs.append(_tensor_info(step_name, outer.inputs[src["input"]]))
            nodes.append(helper.make_node("Identity", [step_name], [free]))
    nodes.extend(body.node)
    cond_out = body.output[0].name
    initializers.append(onnx.numpy_helper.from_array(np.array(1, np.int64), "grape_one"))
    initializers.append(onnx.numpy_helper.from_array(np.zeros(0, np.int64), "grape_scalar"))
    nodes += [
        helper.make_node("Add", [ITER, "grape_one"], ["grape_next_iter"]),
        helper.make_node("Cast", [cond_out], ["grape_cond_bool"], to=onnx.TensorProto.BOOL),
        helper.make_node("Reshape", ["grape_cond_bool", "grape_scalar"], ["grape_next_cond"]),
        helper.make_node("Not", ["grape_next_cond"], [STOP]),
    ]
    outputs = [helper.make_tensor_value_info("grape_next_iter", onnx.TensorProto.INT64, []),
               helper.make_tensor_value_info("grape_next_cond", onnx.TensorProto.BOOL, [])]
    for k, entry in enumerate(carried):
        nodes.append(helper.make_node("Identity", [entry["body_output"]], [f"grape_next_{k}"]))
        outputs.append(_tensor_info(f"grape_next_{k}", inputs[2 + k]))
    outputs.append(helper.make_tensor_value_info(STOP, onnx.TensorProto.BOOL, []))
    graph = helper.make_graph(nodes, f"body of Loop node {name!r}", inputs, outputs, initializers)
    step = helper.make_model(graph, opset_imports=list(model.opset_import))
    step.ir_version = model.ir_version

    graph_outputs = []
    for value in model.graph.output:
        src = outer.source(value.name)
        if src is None:
            raise OnnxLoopError(f"graph output {value.name!r} is not an output of Loop node "
                                f"{name!r}, an input or a constant")
        if "loop_output" in src and src["loop_output"] >= n_carried:
            raise OnnxLoopError(f"Loop node {name!r}: graph output {value.name!r} is a scan output")
        graph_outputs.append({"name": value.name, "source": src})
    return LoopModel(name, step, trip_count, cond, carried, invariants, graph_outputs)


def _check_fixed_state(mod, plan: LoopModel) -> None:
    """Each carried value's next value must have its shape and dtype: name the one that
    does not."""
    main = mod["main"]
    params = {p.name: p.ty for p in main.params}
    rets = list(main.ret_ty.fields) if isinstance(main.ret_ty, relax.TupleType) else [main.ret_ty]
    for k, entry in enumerate(plan.carried):
        want, got = params[entry["state"]], rets[2 + k]
        if not structural_equal(want, got):
            raise OnnxLoopError(
                f"Loop node {plan.node!r}: carried value #{k} ({entry['outer']!r}, body output "
                f"{entry['body_output']!r}) is {want} before a step and {got} after it: grape's "
                "loops keep each carried value's shape and dtype fixed")


def compile_onnx_loop(model: Any, dims: Mapping[str, Any] | None = None, target: Any = "llvm",
                      *, max_steps: int = DEFAULT_MAX_STEPS, **kwargs) -> GrapeModule:
    """Compile an ONNX graph whose computing node is a ``Loop`` into a ``compile_loop``
    module; ``max_steps`` is the step limit when the Loop has no trip count ``M``."""
    if kwargs.get("weights"):
        # its invariants are the step's inputs under names of grape's, bound by OnnxLoop
        raise ValueError("weights= is not supported for a model whose computing node is a Loop")
    proto = normalize_constants(load_onnx(model))
    signature = onnx_signature(proto, dims or {})
    proto, ranges, dim_names = with_identifier_dims(proto, signature.dims)
    plan = split_loop(proto)
    step = import_onnx(plan.step, ranges)
    _check_fixed_state(step, plan)
    carried = [ITER, COND, *[c["state"] for c in plan.carried]]
    module = compile_loop(step, carried, max_steps=max_steps, stop=STOP, dims=ranges,
                          target=target, dim_names=dim_names, **kwargs)
    module.loop["onnx"] = {**plan.to_json(), "signature": signature.to_json()}
    return module
