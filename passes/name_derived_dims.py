"""Give a dimension computed with a division (``(samples - 400) // 320 + 1``) its own name."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.ir.transform import PassContext, module_pass
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.sym.analyzer import Analyzer, ConstIntBound
from tvm_ffi.structural import structural_walk


def _has_division(expr: tirx.PrimExpr) -> bool:
    found = []
    structural_walk(expr, ((tirx.FloorDiv, found.append), (tirx.FloorMod, found.append)))
    return bool(found)


def _derived_dims(ty) -> list[tirx.PrimExpr]:
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return []
    return [d for d in ty.shape.values if not isinstance(d, (tirx.IntImm, tirx.Var))
            and _has_division(d)]


@mutator
class _Namer(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, bounds: dict[str, tuple[int, int]]):
        super().__init__(mod)
        self.bounds = bounds
        # Each name with its expression in the signature's dims: one name per value, however
        # it was written (``(dim5 - 2) // 2 + 1`` and ``(samples - 400) // 320 + 1`` alike).
        self.names: list[tuple[tirx.PrimExpr, tirx.Var]] = []
        self.expand = Analyzer()

    def _know(self, dim: tirx.PrimExpr) -> None:
        # Nested divisions fold into one only when the analyzer knows the dims' ranges.
        for var in tirx.analysis.undefined_vars(dim):
            if var.name in self.bounds:
                self.expand.update(var, ConstIntBound(*self.bounds[var.name]), override=True)

    def _name(self, dim: tirx.PrimExpr) -> tirx.Var:
        self._know(dim)
        expanded = self.expand.simplify(dim)
        for expr, var in self.names:
            if self.expand.can_prove_equal(expr, expanded):
                return var
        var = tirx.Var(f"dim{len(self.names)}", "int64")
        self.names.append((expanded, var))
        self.expand.bind(var, expanded)
        return var

    def _renamed(self, ty: relax.TensorType) -> relax.TensorType:
        derived = _derived_dims(ty)
        shape = [self._name(d) if any(d.same_as(x) for x in derived) else d
                 for d in ty.shape.values]
        return relax.TensorType(shape, ty.dtype)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        ty = value.ty if hasattr(value, "ty") else None
        if not isinstance(binding.var, relax.DataflowVar) or not _derived_dims(ty):
            super().visit_var_binding_(binding)
            return
        plain = self.builder_.emit(value, binding.var.name + "_derived")
        # Through a rank-only cast: a cast straight from the known shape would bind the new
        # variable to the expression, and Relax's normalizer substitutes it back.
        erased = self.builder_.match_cast(plain, relax.TensorType(ndim=ty.ndim, dtype=ty.dtype),
                                          binding.var.name + "_erased")
        named = self.builder_.match_cast(erased, self._renamed(ty), binding.var.name)
        self.set_var_remap(binding.var, named)


def _bounds(func: relax.Function) -> dict[str, tuple[int, int]]:
    attrs = func.attrs or {}
    upper = dict(attrs.get("tir_var_upper_bound", {}))
    lower = dict(attrs.get("tir_var_lower_bound", {}))
    return {str(k): (int(lower.get(k, 0)), int(v)) for k, v in upper.items()}


def _range_of(expr: tirx.PrimExpr, bounds: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
    analyzer = Analyzer()
    for var in tirx.analysis.undefined_vars(expr):
        if var.name not in bounds:
            return None
        analyzer.update(var, ConstIntBound(*bounds[var.name]), override=True)
    bound = analyzer.const_int_bound(expr)
    return int(bound.min_value), int(bound.max_value)


@module_pass(opt_level=0, name="NameDerivedDims")
class NameDerivedDims:
    """A dataflow tensor whose shape has a dimension computed with a division gets a fresh
    dimension variable for it (``R.match_cast``), one per distinct expression.

    TVM's GPU schedules (dlight) cannot schedule a reduction over such an extent: the loop
    bindings ``fused % ((samples - 400) // 320 + 1)`` are not quasi-affine, and every rule,
    ``Fallback`` included, fails (Wav2Vec2's softmax over frames). Over a plain variable
    they schedule. The new variable's range, from the declared ranges, becomes its
    ``tir_var_upper_bound``/``tir_var_lower_bound``: memory is still planned at the bound.
    The cast is a shape check on the host.

    Before (``samples`` in 400..16000)::

        lv: R.Tensor((1, (samples - 400) // 320 + 1, 32)) = R.permute_dims(conv, [0, 2, 1])
        sm = R.nn.softmax(lv)

    After::

        lv_derived: R.Tensor((1, (samples - 400) // 320 + 1, 32)) = R.permute_dims(conv, [0, 2, 1])
        lv: R.Tensor((1, dim0, 32)) = R.match_cast(lv_derived, R.Tensor((1, dim0, 32)))
        sm = R.nn.softmax(lv)                # dim0 in 1..49
    """

    def transform_module(self, mod: tvm.IRModule, ctx: PassContext) -> tvm.IRModule:
        for gvar, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            bounds = _bounds(func)
            namer = _Namer(mod, bounds)
            new = namer.visit_expr(func)
            if not namer.names:
                continue
            upper, lower = dict(new.attrs.get("tir_var_upper_bound", {})), \
                dict(new.attrs.get("tir_var_lower_bound", {}))
            for expr, var in namer.names:  # in order: a name's range may use earlier names
                found = _range_of(expr, bounds)
                if found is None:
                    continue
                bounds[var.name] = max(found[0], 0), found[1]
                lower[var.name], upper[var.name] = bounds[var.name]
            mod[gvar] = new.with_attr("tir_var_upper_bound", upper).with_attr(
                "tir_var_lower_bound", lower)
        return mod
