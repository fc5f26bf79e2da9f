"""A decoder's ``main`` annotated for N devices Megatron's way, found from its dataflow."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import tvm_ffi
from tvm import IRModule, relax, te, tirx
from tvm.ir import Op
from tvm.ir.expr import GenericConst
from tvm.ir.transform import PassContext, module_pass
from tvm.relax.distributed import Placement
from tvm_ffi.structural import structural_equal

from .tensor_parallel import _mesh, with_mesh
from .var_reads import read_counts

COLUMNS_BY_RANKS_ATTR = "grape.columns_by_ranks"  # on main: {param: parts of its last axis}

_MATMUL = Op.get("relax.matmul")
_PERMUTE = Op.get("relax.permute_dims")
# What a block's activations may pass through between its two weight matmuls: element-wise
# ops (a bias, an activation function, attention's scale and mask), the reshapes and
# transposes of its heads, attention itself (products of activations, softmax, the caches'
# concatenation) and the split of a fused qkv product.
_INTERIOR_OPS = frozenset(f"relax.{name}" for name in (
    "add", "subtract", "multiply", "divide", "power", "sqrt", "tanh", "erf", "exp", "sigmoid",
    "negative", "where", "astype", "nn.gelu", "nn.gelu_tanh", "nn.silu", "nn.relu",
    "nn.softmax", "reshape", "permute_dims", "split", "concat", "matmul"))


@tvm_ffi.register_error
class MegatronError(ValueError):
    """The module cannot be sharded Megatron's way; the message says what was found."""


@dataclass
class _Block:
    """Column-parallel weight matmuls (``starts``) whose products reach, through
    ``_INTERIOR_OPS`` alone, one row-parallel weight matmul (``end``)."""

    starts: list[relax.Var]
    end: relax.Var
    interior: set = field(default_factory=set)  # the vars between them
    heads: int | None = None  # attention's heads, where its product is reshaped into them


@dataclass
class _FusedSplit:
    """A split of a fused product's columns into ``parts`` equal parts, rewritten so that
    each rank's contiguous columns hold its heads of every part (``columns_by_ranks``)."""

    parts: int
    params: list[str]  # the weight and bias whose columns are reordered by ranks


def columns_by_ranks(value: np.ndarray, parts: int, world_size: int) -> np.ndarray:
    """``value`` with its last axis's columns, ``parts`` equal parts (a fused qkv: q, k, v),
    reordered by rank: rank ``r``'s contiguous ``1/world_size`` holds the ``r``-th
    ``1/world_size`` of each part, in order; what ``ShardMegatron``'s split of a fused
    product reads."""
    *lead, columns = value.shape
    grouped = value.reshape(*lead, parts, world_size, columns // parts // world_size)
    return np.ascontiguousarray(np.swapaxes(grouped, -3, -2)).reshape(value.shape)


@module_pass(opt_level=0, name="ShardMegatron")
class ShardMegatron:
    """Annotate ``main`` for ``world_size`` devices Megatron's way (``LowerTensorParallel``
    lowers it). A block is a weight matmul whose product reaches a second weight matmul
    through element-wise ops, reshapes, transposes and attention alone (``_INTERIOR_OPS``):
    the first is made column-parallel (its product split on its last axis: a rank computes
    its heads, its part of the MLP's inner dim), the second row-parallel (its product
    replicated: an all-reduce). ``PropagateSharding`` places the rest: the heads, and the
    caches concatenated with them, split on their head axis. Everything else is
    replicated. A split of a column-parallel product into equal parts (a fused qkv) is
    rewritten to read each rank's columns as (part, head of the rank, dim); the weight and
    bias it reads must then come with their columns in that order: ``main``'s
    ``grape.columns_by_ranks`` names them and their parts (``columns_by_ranks`` reorders a
    whole one). Weights are ``main``'s 2-D parameters of static shape (``frontend``'s
    ``initializers_as_inputs``). Refuses (``MegatronError``) a module with no block, a
    block whose heads or columns do not split over ``world_size``, and a product that
    reaches an op outside ``_INTERIOR_OPS`` on its way to a second weight matmul.

    Before (``world_size`` 2; GPT-2's attention, 4 heads of 16, its MLP alike)::

        lv31 = R.matmul(x, w_attn)                                  # w_attn: (64, 192)
        lv32 = R.add(lv31, b_attn)
        lv34 = R.split(lv32, indices_or_sections=[64, 128], axis=1)
        lv35 = lv34[0]
        lv38 = R.reshape(lv35, R.shape([n, 4, 16]))
        ...                                                         # attention
        lv57 = R.matmul(lv56, w_proj)                               # w_proj: (64, 64)

    After (``main`` attributed ``grape.columns_by_ranks`` {"w_attn": 3, "b_attn": 3})::

        lv31 = R.matmul(x, w_attn)
        lv31a = R.dist.annotate_sharding(lv31, "mesh[0]", "S[1]")
        lv32 = R.add(lv31a, b_attn)
        lv32a = R.dist.annotate_sharding(lv32, "mesh[0]", "S[1]")
        by_ranks = R.reshape(lv32a, R.shape([n, 2, 3, 32]))         # (rank, q/k/v, its dims)
        lv35 = R.reshape(R.strided_slice(by_ranks, axes=[2], begin=[0], end=[1]),
                         R.shape([n, 64]))
        lv38 = R.reshape(lv35, R.shape([n, 4, 16]))
        ...
        lv57 = R.matmul(lv56, w_proj)
        lv57a = R.dist.annotate_sharding(lv57, "mesh[0]", "R")
    """

    def __init__(self, world_size: int):
        if not isinstance(world_size, int) or world_size < 2:
            raise MegatronError(f"Megatron sharding takes 2 or more devices, got {world_size!r}")
        self.world_size = world_size

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        func = mod["main"]
        graph = _Dataflow(func)
        blocks = _blocks(graph)
        if not blocks:
            raise MegatronError(
                f"no block to shard over {self.world_size} devices: no weight matmul's product "
                "reaches a second weight matmul through element-wise ops, reshapes, "
                "transposes and attention alone")
        splits = {}
        for block in blocks:
            _check_divides(graph, block, self.world_size)
            splits.update(_fused_splits(graph, block))
        annotated = _Annotate(mod, _placements(graph, blocks), splits,
                              self.world_size).visit_expr(func)
        order = {name: fused.parts for fused in splits.values() for name in fused.params}
        mod = IRModule(dict(mod.functions.items()), attrs=mod.attrs,
                       global_infos=mod.global_infos)
        mod["main"] = annotated.with_attr(COLUMNS_BY_RANKS_ATTR, order)
        return with_mesh(mod, self.world_size)


class _Dataflow:
    """``main``'s bindings: each var's value, its readers, which parameters are weights."""

    def __init__(self, func: relax.Function):
        self.values = {}
        self.readers: dict = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                self.values[binding.var] = binding.value
                for read in read_counts(binding.value):
                    self.readers.setdefault(read, []).append(binding.var)
        self.outputs = set(read_counts(func.body.body))
        self.weights = {p for p in func.params if _is_weight(p)}

    def op(self, var) -> str | None:
        value = self.values.get(var)
        if isinstance(value, relax.Call) and isinstance(value.op, Op):
            return value.op.name
        return None

    def weight_of(self, var):
        """The weight parameter a matmul's product ``var`` multiplies by, or None."""
        value = self.values.get(var)
        if not (isinstance(value, relax.Call) and value.op == _MATMUL):
            return None
        rhs = value.args[1]
        transposed = self.values.get(rhs)
        if isinstance(transposed, relax.Call) and transposed.op == _PERMUTE:
            rhs = transposed.args[0]
        return rhs if rhs in self.weights and value.args[0] not in self.weights else None


def _is_weight(param: relax.Var) -> bool:
    ty = param.ty
    return isinstance(ty, relax.TensorType) and ty.ndim == 2 and ty.shape is not None and all(
        isinstance(d, tirx.IntImm) for d in ty.shape.values)


def _blocks(graph: _Dataflow) -> list[_Block]:
    """Every block of ``graph``: its column-parallel matmuls grouped by the row-parallel one
    they reach."""
    by_end: dict = {}
    starts = set()
    for var in graph.values:
        if graph.weight_of(var) is None:
            continue
        end, interior = _walk(graph, var)
        if end is not None:
            block = by_end.setdefault(end, _Block([], end))
            block.starts.append(var)
            block.interior |= interior
            starts.add(var)
    both = sorted(v.name for v in starts & set(by_end))
    if both:
        raise MegatronError(f"weight matmul {both[0]} ends one block and starts another (no "
                            "normalization between them): Megatron sharding does not chain "
                            "blocks")
    return list(by_end.values())


def _walk(graph: _Dataflow, start) -> tuple:
    """The one weight matmul that ``start``'s product reaches through ``_INTERIOR_OPS``
    (None if none), and the vars on the way; ``MegatronError`` where it also reaches another
    op, or two weight matmuls."""
    ends, stops, seen, todo = set(), set(), set(), [start]
    while todo:
        var = todo.pop()
        for reader in graph.readers.get(var, []):
            if graph.weight_of(reader) is not None:
                ends.add(reader)
            elif reader in seen:
                continue
            elif graph.op(reader) in _INTERIOR_OPS or isinstance(
                    graph.values[reader], (relax.TupleGetItem, relax.Var)):
                seen.add(reader)
                todo.append(reader)
            elif reader not in graph.outputs or graph.op(reader) is not None:
                stops.add(reader)
    if not ends:
        return None, set()
    named = f"the product {start.name} of weight {graph.weight_of(start).name}"
    if len(ends) > 1:
        raise MegatronError(f"{named} reaches {len(ends)} weight matmuls "
                            f"({', '.join(sorted(v.name for v in ends))}): not one block")
    if stops:
        stop = min(stops, key=lambda v: v.name)
        raise MegatronError(f"{named} reaches weight matmul {next(iter(ends)).name} and also "
                            f"{graph.op(stop) or type(graph.values[stop]).__name__} "
                            f"({stop.name}), which Megatron sharding does not understand")
    return next(iter(ends)), seen


def _columns(var) -> int:
    return int(var.ty.shape.values[-1])


def _check_divides(graph: _Dataflow, block: _Block, world_size: int) -> None:
    """Each column-parallel product's columns, and the block's heads, split over
    ``world_size``; ``block.heads`` set from the reshapes of its columns into heads."""
    heads = {_heads(graph, var) for var in block.interior} - {None}
    if len(heads) > 1:
        raise MegatronError(f"the block ending at {block.end.name} reshapes its columns into "
                            f"{sorted(heads)} heads: not one attention")
    block.heads = next(iter(heads), None)
    if block.heads is not None and block.heads % world_size:
        raise MegatronError(f"the attention ending at {block.end.name} (weight "
                            f"{graph.weight_of(block.end).name}) has {block.heads} heads, "
                            f"which do not split over {world_size} devices")
    for start in block.starts:
        if _columns(start) % world_size:
            raise MegatronError(f"the product {start.name} has {_columns(start)} columns, "
                                f"which do not split over {world_size} devices")


def _heads(graph: _Dataflow, var) -> int | None:
    """The heads of a reshape of (..., heads * dim) into (..., heads, dim), else None."""
    value = graph.values[var]
    if graph.op(var) != "relax.reshape":
        return None
    before, after = value.args[0].ty.shape, var.ty.shape
    if before is None or after is None or len(after.values) != len(before.values) + 1:
        return None
    *lead, heads, dim = after.values
    if not all(isinstance(d, tirx.IntImm) for d in (heads, dim, before.values[-1])):
        return None
    if int(heads) < 2 or int(heads) * int(dim) != int(before.values[-1]) or \
            not structural_equal(list(lead), list(before.values[:-1])):
        return None
    return int(heads)


def _fused_splits(graph: _Dataflow, block: _Block) -> dict:
    """The block's splits of a column-parallel product into equal parts on its last axis,
    with the weight and bias whose columns they read."""
    found = {}
    for var in block.interior:
        value = graph.values[var]
        if graph.op(var) != "relax.split":
            continue
        source = value.args[0]
        ndim = source.ty.ndim
        sections = _equal_sections(value, _columns(source))
        if int(value.attrs.axis) % ndim != ndim - 1 or sections is None:
            raise MegatronError(f"{var.name} splits a column-parallel product other than into "
                                "equal parts on its last axis")
        found[var] = _FusedSplit(sections, _column_params(graph, source, _columns(source)))
    return found


def _equal_sections(call: relax.Call, extent: int) -> int | None:
    split = call.attrs.indices_or_sections
    if isinstance(split, (int, tirx.IntImm)):
        return int(split)
    cuts = [0, *(int(i) for i in split), extent]
    sizes = {b - a for a, b in zip(cuts[:-1], cuts[1:])}
    return len(cuts) - 1 if len(sizes) == 1 else None


def _column_params(graph: _Dataflow, var, columns: int) -> list[str]:
    """The parameters whose columns ``var`` holds in order: the weight of the matmul it comes
    from, through reshapes keeping its last axis and bias adds, and those biases."""
    names = []
    while True:
        value = graph.values.get(var)
        weight = graph.weight_of(var)
        if weight is not None:
            if not value.args[1].same_as(weight):
                raise MegatronError(f"{var.name}: a fused product of a transposed weight "
                                    f"({weight.name}) is not supported")
            return [weight.name, *names]
        if graph.op(var) == "relax.reshape" and _columns(value.args[0]) == columns:
            var = value.args[0]
        elif graph.op(var) == "relax.add":
            bias = [a for a in value.args if isinstance(a, relax.Var) and a not in graph.values]
            others = [a for a in value.args if a not in bias]
            if len(bias) != 1 or len(others) != 1:
                break
            names.append(bias[0].name)
            var = others[0]
        else:
            break
    raise MegatronError(f"cannot tell which weight's columns the split product {var.name} "
                        "holds")


def _placements(graph: _Dataflow, blocks: Sequence[_Block]) -> dict:
    """Each var annotated, its placement: a column-parallel product and its bias adds split
    on their last axis, a row-parallel one replicated (the all-reduce)."""
    placements = {}
    for block in blocks:
        placements[block.end] = "R"
        for start in block.starts:
            var = start
            while var is not None:
                placements[var] = f"S[{var.ty.ndim - 1}]"
                var = next((r for r in graph.readers.get(var, []) if graph.op(r) == "relax.add"
                            and any(a in graph.weights or a not in graph.values and a != var
                                    for a in graph.values[r].args)), None)
    return placements


@relax.expr_functor.mutator
class _Annotate(relax.PyExprMutator):
    """``ShardMegatron``'s rewrite of ``main``: the annotations, and the fused splits."""

    def __init__(self, mod: IRModule, placements: dict, splits: dict, world_size: int):
        super().__init__(mod)
        self.world_size = world_size
        self.placements = placements
        self.splits = splits
        self.parts: dict = {}  # a split rewritten -> its parts

    def visit_var_binding_(self, binding):  # pylint: disable=arguments-renamed
        var, value = binding.var, binding.value
        if not isinstance(var, relax.DataflowVar):  # an output: as it is
            super().visit_var_binding_(binding)
        elif var in self.splits:
            self.parts[var] = self._split_by_ranks(self.visit_expr(value.args[0]),
                                                   self.splits[var].parts)
        elif isinstance(value, relax.TupleGetItem) and value.tuple_value in self.parts:
            self.set_var_remap(var, self.parts[value.tuple_value][value.index])
        elif var in self.placements:
            emitted = self.builder_.emit(self.visit_expr(value), var.name)
            self.set_var_remap(var, self.builder_.emit(
                relax.op.distributed.annotate_sharding(
                    emitted, _mesh(self.world_size), Placement.from_text(self.placements[var])),
                f"{var.name}_sharded"))
        else:
            super().visit_var_binding_(binding)

    def _split_by_ranks(self, source: relax.Expr, parts: int) -> list:
        """The ``parts`` equal parts of ``source``'s last axis, its columns in rank order
        (rank, part, column of the rank's): each part's columns in their order."""
        *lead, columns = source.ty.shape.values
        columns = int(columns)
        per_rank = columns // parts // self.world_size
        by_ranks = self.builder_.emit(relax.op.reshape(
            source, [*lead, self.world_size, parts, per_rank]), "by_ranks")
        axis = len(lead) + 1
        return [self.builder_.emit(relax.op.reshape(
            relax.op.strided_slice(by_ranks, axes=[axis], begin=[j], end=[j + 1]),
            [*lead, columns // parts])) for j in range(parts)]


_CALL_TIR = Op.get("relax.call_tir")
_WHERE = Op.get("relax.where")


# The largest constant ``InputForVarlessCalls`` computes in a kernel, one select per element.
_COMPUTED_CONSTANT_LIMIT = 64


@module_pass(opt_level=0, name="InputForVarlessCalls")
class InputForVarlessCalls:
    """Make every call in ``main`` that reads no tensor but constants (an ``arange`` to a
    symbolic length, a constant plus a dim: a decoder's positions) a ``call_tir`` that also
    takes ``main``'s first tensor parameter, unread (one that is a constant: a kernel
    computing it): TVM 0.27's ``PropagateSharding`` fails on a ``call_tir`` whose inputs
    are constants or none ("Index 0 out of bounds 0": it places a call by its inputs), and
    its lowering leaves a constant input of a kernel distributed ("R.dist.const"), which no
    kernel takes, as it does a variable bound to a constant; and a ``where`` of constant
    scalars (attention's mask) reads tensors of them (``_scalars_filled``). Before
    ``ShardMegatron``'s lowering.

    Before (``input_ids``: main's first parameter)::

        lv21 = R.arange(0, past + 1, 1, dtype="int64")

    After::

        lv21 = R.call_tir(arange, (input_ids, R.prim_value(past)),
                          out_ty=R.Tensor((past + 1,), dtype="int64"))
        # arange(unread: T.Buffer((batch, 1), "int64"), past: T.int64, T_arange: ...)
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        main = mod["main"]
        anchor = next((p for p in main.params if isinstance(p.ty, relax.TensorType)
                       and p.ty.shape is not None), None)
        if anchor is None:
            return mod
        given = _GiveInput(mod, anchor)
        given.builder_.update_func(mod.get_global_var("main"), given.visit_expr(main))
        return given.builder_.get()


@relax.expr_functor.mutator
class _GiveInput(relax.PyExprMutator):
    """``InputForVarlessCalls``' rewrite of one call."""

    def __init__(self, mod: IRModule, anchor: relax.Var):
        super().__init__(mod)
        self.anchor = anchor

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not (isinstance(call.op, Op) and isinstance(call.ty, relax.TensorType)) or \
                call.op == _CALL_TIR:
            return call
        if not self._reads_constants_only(call):
            return _scalars_filled(call)

        legalize = call.op.get_attr("FLegalize")
        legalized = legalize(self.builder_, call) if legalize is not None else None
        if isinstance(legalized, GenericConst):
            return self._computed(legalized.value.numpy())
        if not (isinstance(legalized, relax.Call) and legalized.op == _CALL_TIR):
            return call
        gvar, args = legalized.args[0], legalized.args[1]
        func = self.builder_.get()[gvar]
        # at the parameter's own shape: FuseTIR takes one buffer per variable read
        unread = tirx.decl_buffer(list(self.anchor.ty.shape.values), self.anchor.ty.dtype,
                                  "unread")
        # a function of its own: the legalized one may serve other calls, and its
        # GlobalVar's type is its signature
        anchored = self.builder_.add_func(
            tirx.PrimFunc([unread, *func.params], func.body, func.ret_type, func.attrs),
            f"{gvar.name_hint}_anchored")
        return relax.Call(_CALL_TIR, [anchored, relax.Tuple([self.anchor, *args.fields]),
                                      *legalized.args[2:]], legalized.attrs,
                          legalized.ty_args)

    def _computed(self, value: np.ndarray) -> relax.Expr:
        """A kernel computing the constant ``value`` (each element selected by its index),
        reading the anchor unread: the lowering takes no constant input of a kernel."""
        if value.size > _COMPUTED_CONSTANT_LIMIT:
            raise MegatronError(f"a constant of {value.size} elements computed from no input "
                                f"(at most {_COMPUTED_CONSTANT_LIMIT} are made a kernel of "
                                "selects): pass it as an input")
        flat = value.reshape(-1).tolist()
        strides = [int(np.prod(value.shape[k + 1:])) for k in range(value.ndim)]

        def element(*index):
            at = sum((i * stride for i, stride in zip(index, strides)), tirx.const(0, "int64"))
            chosen = tirx.const(flat[-1], str(value.dtype))
            for j in reversed(range(len(flat) - 1)):
                chosen = tirx.Select(at == j, tirx.const(flat[j], str(value.dtype)), chosen)
            return chosen

        return self.builder_.call_te(
            lambda _unread: te.compute(value.shape, element, name="constant"), self.anchor,
            primfunc_name_hint="constant")

    def _reads_constants_only(self, call: relax.Call) -> bool:
        """Whether every tensor ``call`` reads is a constant (or a variable bound to one)."""
        reads = [v for v in read_counts(relax.Tuple(list(call.args))) if _holds_tensor(v.ty)]
        return all(isinstance(self.lookup_binding(v), GenericConst) for v in reads)


def _scalars_filled(call: relax.Call) -> relax.Call:
    """``call`` of ``where`` with each 0-d constant operand a tensor of it shaped as its
    condition (``condition * 0 + value``, whose legalization holds the scalars in its
    kernels): the lowering leaves a constant operand of a kernel distributed
    ("R.dist.const"), which no kernel takes. The same values, broadcast the same."""
    if call.op != _WHERE or not any(_is_scalar_constant(a) for a in call.args):
        return call
    condition = call.args[0]

    def filled(value):  # a tensor shaped as the condition, every element ``value``
        zeros = relax.op.multiply(relax.op.astype(condition, value.ty.dtype),
                                  relax.const(0, value.ty.dtype))
        return relax.op.add(zeros, value)

    args = [filled(a) if _is_scalar_constant(a) else a for a in call.args]
    return relax.Call(call.op, args, call.attrs, call.ty_args)


def _is_scalar_constant(expr) -> bool:
    return isinstance(expr, GenericConst) and expr.ty.ndim == 0


def _holds_tensor(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return any(_holds_tensor(field) for field in ty.fields)
    return isinstance(ty, relax.TensorType)
