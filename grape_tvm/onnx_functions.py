"""ONNX operators TVM's importer lacks, expanded into the function bodies the ONNX standard
defines for them.

Many ONNX operators are *functions*: their schema carries a body in simpler operators
(``SoftmaxCrossEntropyLoss``, ``NegativeLogLikelihoodLoss``, ``Celu``, ``CenterCropPad``,
the window functions, opset 23's ``Attention`` and ``RotaryEmbedding``...), some of them
built for the node at hand (a *context-dependent* function: its body depends on the node's
attributes and input types). TVM 0.27's importer implements none of these
(``OpNotImplemented``), or, for ``Attention``, implements ONNX Runtime's contrib operator of
that name (``num_heads``, one packed QKV weight), not the standard one.

``functions_expanded`` replaces each such node of the main graph by its body, before
import: the body becomes a model-local function called by the node, and onnx's inliner
inlines it (converting the body to the model's opset where the standard wrote it for
another). Expanded bodies may call functions themselves (``SoftmaxCrossEntropyLoss``
calls ``NegativeLogLikelihoodLoss``): expansion repeats until no node needs it.

    before: y = SoftmaxCrossEntropyLoss(scores, labels, reduction="mean")
    after:  log_prob = LogSoftmax(scores); ...; y = ReduceMean(...)   (the standard's body)

Only the main graph is expanded (a node inside an ``If``/``Loop`` body is left as it is).
"""

from __future__ import annotations

import onnx
import onnx.inliner
from tvm.relax.frontend.onnx import onnx_frontend as tvm_onnx

from grape_tvm.onnx_fixes import UnsupportedNode

FUNCTIONS_DOMAIN = "grape.expanded"  # the domain of the model-local functions made here
MAX_ROUNDS = 8  # expansions nested this deep at most (bodies calling functions)

# Standard operators TVM's importer maps to something else of the same name: ONNX Runtime's
# contrib ``Attention`` (com.microsoft) where opset 23 defines its own. op -> since opset.
TVM_MISREADS = {"Attention": 23}


def functions_expanded(model: onnx.ModelProto, opset: int,
                       own_converters: frozenset[str] = frozenset()) -> onnx.ModelProto:
    """``model`` with every main-graph node of the default domain that TVM's importer cannot
    convert (and ``own_converters`` does not hold) replaced by its standard function body;
    ``model`` itself when there is none."""
    implemented = set(tvm_onnx._get_convert_map()) | set(own_converters)  # pylint: disable=protected-access
    for _ in range(MAX_ROUNDS):
        wanted = [i for i, node in enumerate(model.graph.node)
                  if _wants_expansion(node, opset, implemented)]
        if not wanted:
            return model
        # Typed: context-dependent bodies are built for their inputs' types, and the
        # inliner's version conversion needs every value's type.
        model = _typed(model)
        types = _value_types(model)
        functions = {}
        for i in wanted:
            node = model.graph.node[i]
            function = _standard_function(node, opset, types)
            if function is not None:
                functions[i] = function
            elif node.op_type in TVM_MISREADS:
                raise UnsupportedNode(
                    f"{node.op_type} node {node.name or node.output[0]!r}: the standard "
                    f"operator's body cannot be built here (input types unknown), and TVM's "
                    f"{node.op_type} converter is another operator's")
        if not functions:
            return model
        model = _inlined(model, functions, opset)
    return model


def _wants_expansion(node: onnx.NodeProto, opset: int, implemented: set[str]) -> bool:
    if node.domain not in ("", "ai.onnx"):
        return False
    misread_since = TVM_MISREADS.get(node.op_type)
    if misread_since is not None and opset >= misread_since:
        return True
    return node.op_type not in implemented


def _standard_function(node: onnx.NodeProto, opset: int,
                       types: dict[str, onnx.TypeProto]) -> onnx.FunctionProto | None:
    """The standard's body for ``node`` at ``opset`` (its latest version at or before it), or
    None if the operator has none, or a context-dependent one needs an input type that
    shape inference did not find."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    body = None
    versions = [v for v in schema.function_opset_versions if v <= opset]
    if versions:
        body = schema.get_function_with_opset_version(max(versions))
    else:
        versions = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
        if not versions or any(name and name not in types for name in node.input):
            return None
        input_types = [types[name].SerializeToString() if name else
                       onnx.TypeProto().SerializeToString() for name in node.input]
        node_with_defaults = _with_default_attributes(node, schema)
        body = schema.get_context_dependent_function_with_opset_version(
            max(versions), node_with_defaults.SerializeToString(), input_types)
    if not body:
        return None
    return onnx.FunctionProto.FromString(body)


def _with_default_attributes(node: onnx.NodeProto, schema) -> onnx.NodeProto:
    """A copy of ``node`` carrying every attribute its schema gives a default and the node
    leaves out: a function body refers to attributes by name, defaults included."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    given = {a.name for a in node.attribute}
    for name, attribute in schema.attributes.items():
        if name not in given and attribute.default_value.name:
            copy.attribute.append(attribute.default_value)
    return copy


def _inlined(model: onnx.ModelProto, functions: dict[int, onnx.FunctionProto],
             opset: int) -> onnx.ModelProto:
    """``model`` with node ``i`` calling ``functions[i]`` as a model-local function, inlined."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    taken = {(f.domain, f.name) for f in model.functions}
    for i, function in functions.items():
        node = model.graph.node[i]
        schema = onnx.defs.get_schema(node.op_type, opset, "")
        node.CopyFrom(_with_default_attributes(node, schema))
        name = f"{node.op_type}_{i}"
        while (FUNCTIONS_DOMAIN, name) in taken:
            name += "_"
        taken.add((FUNCTIONS_DOMAIN, name))
        function.domain, function.name = FUNCTIONS_DOMAIN, name
        node.domain, node.op_type = FUNCTIONS_DOMAIN, name
        model.functions.append(function)
    if not any(o.domain == FUNCTIONS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(FUNCTIONS_DOMAIN, 1))
    inlined = onnx.inliner.inline_local_functions(model, convert_version=True)
    del inlined.opset_import[:]
    inlined.opset_import.extend(o for o in model.opset_import if o.domain != FUNCTIONS_DOMAIN)
    return inlined


def _typed(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the types shape inference finds for its values (``value_info``), or
    as it is when shape inference rejects it."""
    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # pylint: disable=broad-except
        return model


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every main-graph value's type that the model declares (``_typed`` first)."""
    graph = model.graph
    types = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
    for tensor in graph.initializer:
        types.setdefault(tensor.name, onnx.helper.make_tensor_type_proto(
            tensor.data_type, list(tensor.dims)))
    return types
