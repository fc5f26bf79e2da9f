"""Shapes computed in small integer tensors, folded back into shape expressions."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, tirx
from tvm.ir.transform import PassContext, module_pass
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.sym.analyzer import Analyzer
from tvm_ffi import structural_map
from tvm_ffi.structural import structural_equal

MAX_ELEMENTS = 64  # a shape tensor is a handful of dims; larger ones are data


@dataclass(frozen=True)
class _Known:
    """A tensor of rank 0 or 1 whose every element is known as an expression of dims."""

    dtype: str
    values: tuple[tirx.PrimExpr, ...]
    scalar: bool  # rank 0 (one value)


def _const_known(const: tvm.ir.GenericConst) -> _Known | None:
    array = const.value.numpy()
    dtype = str(array.dtype)
    if array.ndim > 1 or array.size > MAX_ELEMENTS or \
            not (dtype == "bool" or dtype.startswith(("int", "uint"))):
        return None
    values = tuple(tirx.const(bool(v) if dtype == "bool" else int(v), dtype)
                   for v in array.reshape(-1))
    return _Known(dtype, values, array.ndim == 0)


def _cast(value: tirx.PrimExpr, dtype: str) -> tirx.PrimExpr:
    if str(value.ty) == dtype:
        return value
    if dtype == "bool":
        return value != tirx.const(0, str(value.ty))
    if str(value.ty) == "bool":
        return tirx.Select(value, tirx.const(1, dtype), tirx.const(0, dtype))
    return tirx.Cast(dtype, value)


def _broadcast(*knowns: _Known) -> list[tuple[tirx.PrimExpr, ...]] | None:
    """The elements of ``knowns`` broadcast to one length (a scalar or length 1 repeats)."""
    length = max(len(k.values) for k in knowns)
    if any(len(k.values) not in (1, length) for k in knowns):
        return None
    return [tuple(k.values[i if len(k.values) > 1 else 0] for k in knowns) for i in range(length)]


_BINARY = {
    "relax.add": lambda a, b: a + b,
    "relax.subtract": lambda a, b: a - b,
    "relax.multiply": lambda a, b: a * b,
    "relax.divide": tirx.truncdiv,  # integer Div truncates, as TVM's kernel does
    "relax.floor_divide": tirx.floordiv,
    "relax.floor_mod": tirx.floormod,
    "relax.mod": tirx.truncmod,
    "relax.maximum": tirx.max,
    "relax.minimum": tirx.min,
}
_COMPARE = {
    "relax.equal": lambda a, b: a == b,
    "relax.not_equal": lambda a, b: a != b,
    "relax.less": lambda a, b: a < b,
    "relax.less_equal": lambda a, b: a <= b,
    "relax.greater": lambda a, b: a > b,
    "relax.greater_equal": lambda a, b: a >= b,
    "relax.logical_and": tirx.all,
    "relax.logical_or": tirx.any,
}


def _is_tensor_to_shape(value: relax.Expr) -> bool:
    """``R.tensor_to_shape(t)``, or the VM builtin TVM's importer calls for it."""
    if not isinstance(value, relax.Call):
        return False
    if isinstance(value.op, tvm.ir.Op):
        return value.op.name == "relax.tensor_to_shape"
    return isinstance(value.op, relax.ExternFunc) and \
        value.op.global_symbol == "vm.builtin.tensor_to_shape"


class _ShapeValues:
    """Which tensors of a function's top-level bindings hold known values, and which fresh
    dims the shapes read from them give."""

    def __init__(self, func: relax.Function):
        self.known: dict[relax.Var, _Known] = {}
        self.shape_of: dict[relax.Var, relax.Var] = {}  # tensor_to_shape result -> tensor
        self.dims: dict[tirx.Var, tirx.PrimExpr] = {}   # a matched fresh dim -> its value
        # A folded cast's tensor_to_shape result -> the shape: BindSymbolicVars keeps such
        # a var (its type, Shape(ndim=k), has no fresh dim), where it remakes the cast's.
        self.folded: dict[relax.Var, list[tirx.PrimExpr]] = {}
        self.reads: set[relax.Var] = set()              # those results no longer used
        # Dims defined so far: a match_cast may only bind dims not defined before it.
        self.defined: set[tirx.Var] = {v for p in func.params
                                       for v in relax.analysis.definable_tir_vars_in_type(p.ty)}
        self.analyzer = Analyzer()

    def visit(self, func: relax.Function) -> None:
        uses: dict[relax.Var, int] = {}
        for var in relax.analysis.free_vars(func.body.body):
            uses[var] = uses.get(var, 0) + 1
        for block in func.body.blocks:
            for binding in block.bindings:
                for var in relax.analysis.free_vars(binding.value):
                    uses[var] = uses.get(var, 0) + 1
                if isinstance(binding, relax.MatchCast):
                    self.match_cast(binding)
                    self.defined.update(relax.analysis.definable_tir_vars_in_type(binding.ty))
                else:
                    self.var_binding(binding)
        # A read used elsewhere too stays (it is a host step, not dead code to DCE).
        self.reads = {var for var in self.folded if uses.get(var, 0) == 1}

    def _exact(self, known: _Known) -> _Known:
        """``known`` in the defined dims: the dims folded so far substituted (a shape
        computed from a folded shape), simplified."""
        return _Known(known.dtype, tuple(
            self.analyzer.simplify(structural_map(v, (tvm.ir.Var, lambda d: self.dims.get(d, d)),
                                                  order="post"))
            for v in known.values), known.scalar)

    def lookup(self, expr: relax.Expr) -> _Known | None:
        if isinstance(expr, tvm.ir.GenericConst):
            return _const_known(expr)
        return self.known.get(expr) if isinstance(expr, relax.Var) else None

    def var_binding(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if _is_tensor_to_shape(value) and isinstance(value.args[0], relax.Var):
            self.shape_of[binding.var] = value.args[0]
            return
        known = self.evaluate(value)
        if known is not None and len(known.values) <= MAX_ELEMENTS:
            self.known[binding.var] = self._exact(known)

    def match_cast(self, binding: relax.MatchCast) -> None:
        """Record a known tensor's exact type, or a shape's fresh dims."""
        value, target = binding.value, binding.ty
        if isinstance(target, relax.TensorType):
            known = self.evaluate(value)  # a Var, or a call the importer cast inline
            if known is not None and len(known.values) <= MAX_ELEMENTS:
                self.known[binding.var] = self._exact(known)
            return
        tensor = self.shape_of.get(value) if isinstance(value, relax.Var) else None
        known = self.known.get(tensor) if tensor is not None else None
        if known is None or not isinstance(target, relax.ShapeType) or target.values is None \
                or len(target.values) != len(known.values) or value in self.folded:
            return
        fresh = list(target.values)
        # Only dims this cast defines, each once: a dim defined before, or repeated, is a
        # check the cast makes at run time, which folding would drop.
        if not all(isinstance(d, tirx.Var) and d not in self.defined for d in fresh) or \
                len({d.name for d in fresh}) != len(fresh):
            return
        values = [_cast(expr, "int64") for expr in known.values]
        self.dims.update(zip(fresh, values))
        self.folded[value] = values

    def evaluate(self, value: relax.Expr) -> _Known | None:
        """``value``'s elements, when it is an op on known tensors this pass evaluates."""
        if isinstance(value, (tvm.ir.GenericConst, relax.Var)):
            return self.lookup(value)
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return None
        op, args, out = value.op.name, value.args, value.ty
        if op == "relax.shape_to_tensor" and isinstance(args[0], relax.ShapeExpr):
            return _Known("int64", tuple(_cast(v, "int64") for v in args[0].values), False)
        if not isinstance(out, relax.TensorType) or out.ndim not in (0, 1):
            return None
        dtype, scalar = str(out.dtype), out.ndim == 0
        if op == "relax.concat" and isinstance(args[0], relax.Tuple):
            parts = [self.lookup(f) for f in args[0].fields]
            return None if any(p is None for p in parts) else \
                _Known(dtype, tuple(v for p in parts for v in p.values), False)
        knowns = [self.lookup(a) for a in args]
        if knowns and knowns[0] is not None and \
                op in ("relax.reshape", "relax.squeeze", "relax.expand_dims"):
            return _Known(dtype, knowns[0].values, scalar)
        if op == "relax.prod" and knowns and knowns[0] is not None and scalar:
            total = tirx.const(1, dtype)
            for v in knowns[0].values:
                total = total * v
            return _Known(dtype, (total,), True)
        if op == "relax.take":
            return _take(knowns, dtype, scalar)
        return _elementwise(op, knowns, dtype, scalar)


def _take(knowns: list, dtype: str, scalar: bool) -> _Known | None:
    if len(knowns) < 2 or knowns[0] is None or knowns[1] is None or \
            not all(isinstance(i, tirx.IntImm) for i in knowns[1].values):
        return None
    n = len(knowns[0].values)
    picked = [int(i.value) for i in knowns[1].values]
    if not all(-n <= i < n for i in picked):
        return None
    return _Known(dtype, tuple(knowns[0].values[i] for i in picked), scalar)


def _elementwise(op: str, knowns: list, dtype: str, scalar: bool) -> _Known | None:
    if not knowns or any(k is None for k in knowns):
        return None
    if op == "relax.astype":
        return _Known(dtype, tuple(_cast(v, dtype) for v in knowns[0].values), scalar)
    if op == "relax.logical_not":
        return _Known(dtype, tuple(tirx.Not(_cast(v, "bool")) for v in knowns[0].values),
                      scalar)
    if op == "relax.negative":
        return _Known(dtype, tuple(-v for v in knowns[0].values), scalar)
    if op == "relax.where" and len(knowns) == 3:
        rows = _broadcast(*knowns)
        return None if rows is None else _Known(
            dtype, tuple(tirx.Select(_cast(c, "bool"), a, b) for c, a, b in rows), scalar)
    function = _BINARY.get(op) or _COMPARE.get(op)
    if function is None or len(knowns) != 2 or (op in _BINARY and "int" not in dtype):
        return None
    rows = _broadcast(*knowns)
    return None if rows is None else _Known(dtype, tuple(function(a, b) for a, b in rows),
                                            scalar)


@mutator
class _Fold(PyExprMutator):
    """The folded ``match_cast(tensor_to_shape(t), R.Shape([...]))`` bindings as the shapes
    themselves, without the ``tensor_to_shape`` (a host read, which dead-code elimination
    keeps: ``call_packed`` counts as impure). The fresh dims are bound afterwards."""

    def __init__(self, mod: tvm.IRModule, folded: dict[relax.Var, list[tirx.PrimExpr]],
                 reads: set[relax.Var]):
        super().__init__(mod)
        self.folded, self.reads = folded, reads

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.reads:  # a read of a folded shape: no longer needed
            super().visit_var_binding_(binding)

    def visit_match_cast_(self, binding: relax.MatchCast) -> None:
        values = self.folded.get(binding.value)
        # The cast the analysis folded, its dims bound: its shape is exactly the values.
        if values is None or not isinstance(binding.ty, relax.ShapeType) or \
                not structural_equal(list(binding.ty.values), values):
            super().visit_match_cast_(binding)
            return
        self.set_var_remap(binding.var, self.builder_.emit(relax.ShapeExpr(values),
                                                           binding.var.name))


def _fold_function(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    values = _ShapeValues(mod[name])
    values.visit(mod[name])
    if not values.dims:
        return mod
    mod = relax.transform.BindSymbolicVars(values.dims, name)(mod)
    mod[name] = _Fold(mod, values.folded, values.reads).visit_expr(mod[name])
    return mod


@module_pass(opt_level=0, name="FoldShapeTensors")
class FoldShapeTensors:
    """Dims matched from a shape tensor whose elements are known: replaced by their values.

    An importer that computes a shape in a tensor (ONNX's ``Div`` of two head counts, a
    ``Concat`` of a shape's slice with it, then ``Expand`` to it) reads it back with
    ``tensor_to_shape`` and matches it to fresh dims. Those dims are unrelated to the
    inputs' (kernels index with them as unknowns, and the call needs the host to read the
    tensor). Where every element of the tensor is an integer expression of known dims, the
    fresh dims are those expressions::

        # before
        n = R.shape_to_tensor(R.shape([b, 8]))                 # [b, 8]
        heads = R.floor_divide(n, R.const([1, 2], "int64"))    # [b, 4]
        s = R.tensor_to_shape(heads)
        s1 = R.match_cast(s, R.Shape([x_0, x_1]))
        y = R.reshape(x, s1)                                   # (x_0, x_1)
        # after
        s1 = R.shape([b, 4])
        y = R.reshape(x, s1)                                   # (b, 4)

    The evaluated ops: ``shape_to_tensor``, integer and boolean constants, ``astype``,
    integer arithmetic, comparisons, ``logical_*``, ``where``, ``concat``, ``take`` at
    constant indices, and rank-0/1 reshapes. Others leave their tensor unknown and its
    dims as they are.
    """

    def transform_module(self, mod: tvm.IRModule, ctx: PassContext) -> tvm.IRModule:
        del ctx
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                mod = _fold_function(mod, gv.name_hint)
        return relax.transform.DeadCodeElimination()(mod)
