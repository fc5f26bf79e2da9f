"""A model annotated with sharding placements, lowered to the program each rank runs."""

from __future__ import annotations

import math

import tvm
from tvm import IRModule, relax
from tvm.ir.transform import PassContext, module_pass
from tvm.relax.distributed import Placement, device_mesh
from tvm.relax.distributed import transform as distributed
from tvm_ffi.structural import structural_equal

from grape_tvm.runtime.nccl import CollectiveFunction
from grape_tvm.runtime.tensor_parallel import rank_inputs

from .var_reads import read_counts

MESH = "mesh"  # the module's global info naming its device mesh
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _mesh(world_size: int):
    """The 1-D mesh of ``world_size`` devices."""
    return device_mesh((world_size,), tvm.ir.Range(0, world_size))


def with_mesh(mod: IRModule, world_size: int) -> IRModule:
    """``mod`` declared to run on ``world_size`` devices: a 1-D mesh ``mesh[0]``."""
    mod = mod.with_attr("device_num", world_size)
    mod.update_global_info(MESH, [_mesh(world_size)])
    return mod


def shard(bb: relax.BlockBuilder, value: relax.Expr, placement: str, world_size: int) -> relax.Expr:
    """Emit ``value`` annotated with ``placement`` ("R", "S[axis]") on a 1-D mesh of
    ``world_size`` devices; ``value`` itself where there is one device."""
    if world_size == 1:
        return value
    return bb.emit(relax.op.distributed.annotate_sharding(value, _mesh(world_size),
                                                          Placement.from_text(placement)))


@module_pass(opt_level=0, name="LowerTensorParallel")
class LowerTensorParallel:
    """Lower a module whose values carry sharding annotations (``shard``; a mesh from
    ``with_mesh``) to the one program every rank runs, with TVM's ``relax.distributed``
    passes: ``PropagateSharding`` gives every value a placement, ``LowerGlobalViewToLocalView``
    rewrites each kernel for its rank's part and inserts the collectives,
    ``LegalizeRedistribute`` and ``LowerDistIR`` make it a plain Relax program of local
    shapes calling ``R.ccl.*``. ``LegalizeOps`` comes first: on high-level ops
    (``R.matmul``) the propagation gives a row-parallel matmul's output no all-reduce (each
    rank returned its partial sum, tried on TVM 0.27); on ``call_tir`` it does. The
    functions it makes of ``RAISED_OPS`` (matmul, permute_dims, add, GELU) carry the op
    they came from, and
    ``RaiseLegalizedOps`` makes each rank's calls of them that op again, at the rank's
    shapes: grape's pipeline then runs a rank's matmuls as it runs one device's (cuBLASLt
    on CUDA, ``OffloadMatmul``). The rest stays TVM's legalization, scheduled by grape's
    rules.

    Before (``world_size`` 2; the MLP's hidden activation split by columns, the output
    replicated)::

        lv0 = R.matmul(x, w1)                                   # w1: (64, 256)
        lv1 = R.dist.annotate_sharding(R.nn.gelu(lv0), "mesh[0]", "S[1]")
        lv2 = R.dist.annotate_sharding(R.matmul(lv1, w2), "mesh[0]", "R")

    After (each rank)::

        x_r = R.ccl.broadcast_from_worker0(x)
        w1_r = R.ccl.scatter_from_worker0(w1, num_workers=2, axis=1)   # (64, 128)
        w2_r = R.ccl.scatter_from_worker0(w2, num_workers=2, axis=0)   # (128, 64)
        lv0 = R.matmul(x_r, w1_r)                                       # (n, 128)
        lv1 = R.call_tir(gelu, (lv0,), out_ty=R.Tensor((n, 128)))
        part = R.matmul(lv1, w2_r)                                      # (n, 64)
        lv2 = R.ccl.allreduce(part, op_type="sum")

    Inputs come in whole, as one device would take them, and are scattered or broadcast
    from rank 0 on every call; ``LocalParams`` then makes each rank's part its parameter.
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        return tvm.transform.Sequential([
            relax.transform.LegalizeOps({op: _legalize_tagged(op) for op in RAISED_OPS}),
            distributed.PropagateSharding(),
            distributed.LowerGlobalViewToLocalView(),
            distributed.LegalizeRedistribute(),
            distributed.LowerDistIR(),
            RaiseLegalizedOps(),
        ])(mod)


# Ops whose call is rebuilt from a legalized function's call: their Relax arguments are the
# call_tir's (tensors only) and scalar constants, which the legalization folds into the
# function (kept in its attributes, put back in place), and their attributes hold no shape,
# so the op at a rank's shapes is the same op on the rank's tensors. What OffloadMatmul
# fuses into a library call, and attention's scale and softmax, which FuseAttention takes
# with its two products into one kernel.
RAISED_OPS = ("relax.matmul", "relax.permute_dims", "relax.add", "relax.nn.gelu",
              "relax.nn.gelu_tanh", "relax.multiply", "relax.divide", "relax.nn.softmax")
LEGALIZED_OP_ATTR = "grape.legalized_op"  # on a PrimFunc: the op it was legalized from
LEGALIZED_ATTRS_ATTR = "grape.legalized_attrs"  # and that op's attributes
LEGALIZED_SCALARS_ATTR = "grape.legalized_scalars"  # and its scalar constants, by position


def _scalar_constants(call: relax.Call) -> dict | None:
    """The call's constant arguments by position, or None where one is not a scalar: a
    larger constant would be the whole of what a rank holds a part of."""
    constants = {i: a for i, a in enumerate(call.args) if isinstance(a, tvm.ir.GenericConst)}
    if any(math.prod(c.value.shape) != 1 for c in constants.values()):
        return None
    return constants


def _legalize_tagged(op_name: str):
    """TVM's legalization of ``op_name``, its function tagged with the op, its attributes
    and its scalar constants (a call with a larger constant keeps TVM's legalization)."""
    legalize = tvm.ir.Op.get(op_name).get_attr("FLegalize")

    def tagged(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        legalized = legalize(bb, call)
        constants = _scalar_constants(call)
        if isinstance(legalized, relax.Call) and legalized.op == _CALL_TIR and \
                constants is not None:
            gvar = legalized.args[0]
            func = bb.get()[gvar].with_attr(LEGALIZED_OP_ATTR, op_name)
            if call.attrs is not None:
                func = func.with_attr(LEGALIZED_ATTRS_ATTR, call.attrs)
            if constants:
                func = func.with_attr(LEGALIZED_SCALARS_ATTR,
                                      {str(i): c for i, c in constants.items()})
            bb.update_func(gvar, func)
        return legalized

    return tagged


@module_pass(opt_level=0, name="RaiseLegalizedOps")
class RaiseLegalizedOps:
    """Make each ``call_tir`` of a function tagged by ``_legalize_tagged`` the op it was
    legalized from, on the call's arguments, where the op's inferred type is the call's
    output type (else the call stays); drop the functions no longer called. After
    ``LowerTensorParallel``'s lowering, whose per-rank copies of the functions keep the tags.

    Before (rank's shapes; ``matmul6`` tagged ``relax.matmul``)::

        lv1 = R.call_tir(matmul6, (lv, w_qkv), out_ty=R.Tensor((1, 96), dtype="float32"))

    After::

        lv1: R.Tensor((1, 96), dtype="float32") = R.matmul(lv, w_qkv)
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        raised = _Raise(mod)
        relax_functions = []
        for gvar, func in mod.functions.items():
            if isinstance(func, relax.Function):
                raised.builder_.update_func(gvar, raised.visit_expr(func))
                relax_functions.append(gvar.name_hint)
        # Every Relax function kept (called or not, public or not): only what they no
        # longer call goes.
        return relax.transform.DeadCodeElimination(relax_functions)(raised.builder_.get())


@relax.expr_functor.mutator
class _Raise(relax.PyExprMutator):
    """``RaiseLegalizedOps``'s rewrite of the calls in one module's Relax functions."""

    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.mod = mod

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if call.op != _CALL_TIR:
            return call
        func = self.mod[call.args[0]]
        op_name = func.attrs.get(LEGALIZED_OP_ATTR) if func.attrs is not None else None
        if op_name is None:
            return call
        # The lowering passes a symbolic dim the function reads as a value after the tensors
        # (a PrimValue): the op takes the tensors alone.
        op = tvm.ir.Op.get(str(op_name))
        tensors = [a for a in call.args[1].fields if isinstance(a.ty, relax.TensorType)]
        args = _with_scalars(tensors, func.attrs.get(LEGALIZED_SCALARS_ATTR) or {})
        if len(args) != int(op.num_inputs):
            return call
        raised = self.builder_.normalize(relax.Call(op, args,
                                                    func.attrs.get(LEGALIZED_ATTRS_ATTR)))
        if not structural_equal(raised.ty, call.ty):
            return call
        return raised


def _with_scalars(tensors: list, scalars) -> list:
    """The op's arguments: the call's tensors, the scalar constants back at their
    positions."""
    args = list(tensors)
    for position in sorted(int(i) for i in scalars):
        args.insert(position, scalars[str(position)])
    return args


SHARD_PLAN_ATTR = "grape.shard_plan"  # on main: {parameter name: the axis it is split on}
_SCATTER = tvm.ir.Op.get("relax.ccl.scatter_from_worker0")
_BROADCAST = tvm.ir.Op.get("relax.ccl.broadcast_from_worker0")


@module_pass(opt_level=0, name="LocalParams")
class LocalParams:
    """Give each rank's ``main`` its part of every parameter it scatters and reads nowhere
    else, and the whole of every parameter it broadcasts, as parameters: no collective moves
    them on a call (a value computed inside, or a parameter also read whole, keeps its
    collective). Each
    rank is then handed its own part once (a weight when bound, a cache as it lives on that
    rank); the parts are rank ``r``'s ``r``-th of ``num_workers`` equal slices along the axis
    ``main``'s ``grape.shard_plan`` names (``shard_inputs``). After ``LowerTensorParallel``.

    Before::

        def main(x: R.Tensor((n, 64)), w1: R.Tensor((64, 256))):
            xr = R.ccl.broadcast_from_worker0(x)
            w1r = R.ccl.scatter_from_worker0(w1, num_workers=2, axis=1)   # (64, 128)
            lv0 = R.matmul(xr, w1r)

    After::

        def main(x: R.Tensor((n, 64)), w1: R.Tensor((64, 128))):   # shard_plan {"w1": 1}
            lv0 = R.matmul(x, w1)
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        func = mod["main"]
        reads = read_counts(func.body)
        replaced: dict = {}  # a collective's var -> the parameter standing for its value
        params = list(func.params)
        plan: dict[str, int] = {}
        for var, value in relax.analysis.get_var2val(func).items():
            if not isinstance(value, relax.Call) or value.op not in (_SCATTER, _BROADCAST):
                continue
            source = value.args[0]
            position = next((i for i, p in enumerate(params) if source.same_as(p)), None)
            if position is None:
                continue  # a value computed inside: its collective stays
            if value.op == _BROADCAST:
                replaced[var] = source
            elif reads.get(source, 0) == 1:  # read by its scatter alone: its part instead
                params[position] = replaced[var] = relax.Var(source.name, value.ty)
                plan[source.name] = int(value.attrs.axis)
        if not replaced:
            return mod
        new_func = relax.Function(params, _Substitute(replaced).visit_expr(func.body),
                                  func.ret_ty, func.is_pure, func.attrs, func.span)
        mod = IRModule(dict(mod.functions.items()), attrs=mod.attrs,
                       global_infos=mod.global_infos)
        mod["main"] = new_func.with_attr(SHARD_PLAN_ATTR, plan)
        return mod


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    """Replace variables by others (``remap``) wherever they are read, and drop their
    bindings (the collectives replaced, which read the parameters given up)."""

    def __init__(self, remap: dict):
        super().__init__()
        self.remap = remap

    def visit_var_binding_(self, binding):  # pylint: disable=arguments-renamed
        if binding.var not in self.remap:
            super().visit_var_binding_(binding)

    def visit_var_(self, var):  # pylint: disable=arguments-renamed
        return self.remap.get(var, var)

    def visit_dataflow_var_(self, var):  # pylint: disable=arguments-renamed
        return self.remap.get(var, var)


def shard_inputs(mod: IRModule, inputs: dict, rank: int) -> dict:
    """Rank ``rank``'s inputs of ``mod``'s ``main`` (after ``LocalParams``): each input its
    ``grape.shard_plan`` names, its ``rank``-th of ``device_num`` equal slices along its axis
    (the part disco's ``scatter_from_worker0`` would have sent it), the others whole.
    ``inputs``: name to numpy array."""
    return rank_inputs(shard_plan(mod), int(mod.attrs["device_num"]), inputs, rank)


def shard_plan(mod: IRModule) -> dict[str, int]:
    """``main``'s ``grape.shard_plan``: an input split across the ranks -> its axis."""
    return {str(k): int(v) for k, v in (mod["main"].attrs.get(SHARD_PLAN_ATTR) or {}).items()}


_ALLREDUCE = tvm.ir.Op.get("relax.ccl.allreduce")
_ALLGATHER = tvm.ir.Op.get("relax.ccl.allgather")


@relax.expr_functor.mutator
class _CollectivesAsLibraryCalls(relax.PyExprMutator):
    """``CollectivesAsLibraryCalls``'s rewrite of one function's collectives."""

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if call.op not in (_ALLREDUCE, _ALLGATHER):
            return call
        # in_group or not: grape's sessions have one group, all the ranks
        function = CollectiveFunction("allreduce", str(call.attrs.op_type)) \
            if call.op == _ALLREDUCE else CollectiveFunction("allgather")
        return relax.call_dps_packed(function.name, [call.args[0]], out_ty=call.ty)


@module_pass(opt_level=0, name="CollectivesAsLibraryCalls")
class CollectivesAsLibraryCalls:
    """Make each all-reduce and all-gather across the ranks a call of grape's NCCL library
    (``runtime/nccl.py``), a kernel of the graph region it is in. TVM legalizes them into
    calls of disco's builtins, which the regions cannot hold: each would split a rank's step
    into two graphs and run between them on the host. On the CPU grape's function calls
    disco's builtin itself.

    Before (a rank's program, after ``LowerTensorParallel``)::

        lv37 = R.ccl.allreduce(lv_1, op_type="sum", in_group=False)

    After::

        lv37 = R.call_dps_packed("grape.nccl.allreduce_sum", (lv_1,),
                                 out_ty=R.Tensor((1, 64), dtype="float32"))
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        rewrite = _CollectivesAsLibraryCalls(mod)
        for gvar, func in mod.functions.items():
            if isinstance(func, relax.Function):
                rewrite.builder_.update_func(gvar, rewrite.visit_expr(func))
        return rewrite.builder_.get()
