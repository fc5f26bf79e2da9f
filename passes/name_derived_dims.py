"""Give a dimension computed with a division (``(samples - 400) // 320 + 1``) its own name."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.ir.transform import PassContext, module_pass
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.sym.analyzer import Analyzer, ConstIntBound
from tvm_ffi.structural import structural_equal, structural_walk


def _has_division(expr: tirx.PrimExpr) -> bool:
    found = []
    structural_walk(expr, ((tirx.FloorDiv, found.append), (tirx.FloorMod, found.append)))
    return bool(found)


def _derived_dims(ty) -> list[tirx.PrimExpr]:
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return []
    return [d for d in ty.shape.values if not isinstance(d, (tirx.IntImm, tirx.Var))
            and _has_division(d)]


def _or(value, default):
    return default if value is None else value


def _substitute(value: relax.Expr, names: dict) -> relax.Expr:
    """``value`` (a call) with the derived dims of its shape arguments (``R.reshape``'s
    target, ...) replaced by their names: ``names`` maps a dim to its name or None."""
    if not isinstance(value, relax.Call):
        return value
    args, changed = [], False
    for arg in value.args:
        if isinstance(arg, relax.ShapeExpr):
            dims = [_or(names(d), d) if _has_division(d) and not isinstance(d, tirx.Var) else d
                    for d in arg.values]
            if any(not a.same_as(b) for a, b in zip(dims, arg.values)):
                arg, changed = relax.ShapeExpr(dims), True
        args.append(arg)
    return relax.Call(value.op, args, value.attrs, value.ty_args) if changed else value


@mutator
class _Namer(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, bounds: dict[str, tuple[int, int]]):
        super().__init__(mod)
        self.bounds = bounds
        # Each name with its expression in the signature's dims: one name per value, however
        # it was written (``(dim5 - 2) // 2 + 1`` and ``(samples - 400) // 320 + 1`` alike).
        self.names: list[tuple[tirx.PrimExpr, tirx.Var]] = []
        # Names defined at the function's start, from the parameters' dims.
        self.hoisted: set[str] = set()
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

    def _hoisted_name(self, dim: tirx.PrimExpr) -> tirx.Var | None:
        var = self._name(dim)
        return var if var.name in self.hoisted else None

    def hoist(self, func: relax.Function) -> list[relax.Binding]:
        """Name every derived dim of the function's bindings; those computed from the
        parameters' dims alone are defined at the start by two shape casts, returned."""
        params = {v.name for p in func.params
                  for v in relax.analysis.definable_tir_vars_in_type(p.ty)}
        if not isinstance(func.body, relax.SeqExpr) or not func.body.blocks:
            return []
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding.var, relax.DataflowVar):
                    for dim in _derived_dims(binding.var.ty):
                        self._name(dim)
        hoisted = [(e, v) for e, v in self.names
                   if {u.name for u in tirx.analysis.undefined_vars(e)} <= params]
        if not hoisted:
            return []
        self.hoisted = {v.name for _, v in hoisted}
        var = relax.DataflowVar if isinstance(func.body.blocks[0], relax.DataflowBlock) \
            else relax.Var
        # Through a rank-only cast, as for tensors below: a cast straight from the known
        # values binds the names to the expressions, and Relax substitutes them back.
        # The values bound to a variable first: VMShapeLower computes the expressions of
        # bindings' types, not those inside a cast's value.
        exprs = [e for e, _ in hoisted]
        values = var("derived_dims_values", relax.ShapeType(exprs))
        erased = var("derived_dims_erased", relax.ShapeType(ndim=len(hoisted)))
        named = var("derived_dims", relax.ShapeType([v for _, v in hoisted]))
        return [relax.VarBinding(values, relax.ShapeExpr(exprs)),
                relax.MatchCast(erased, values, relax.ShapeType(ndim=len(hoisted))),
                relax.MatchCast(named, erased, relax.ShapeType([v for _, v in hoisted]))]

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
        # A reshape (or any call with a shape argument) to a derived dim takes its name.
        renamed = _substitute(value, self._hoisted_name)
        if renamed is not value:
            renamed = self.builder_.normalize(renamed)
            if not _derived_dims(renamed.ty):
                self.set_var_remap(binding.var, self.builder_.emit(renamed, binding.var.name))
                return
            value = renamed
            ty = value.ty
        plain = self.builder_.emit(value, binding.var.name + "_derived")
        target = self._renamed(ty)
        if all(self._name(d).name in self.hoisted for d in _derived_dims(ty)):
            # Every name is defined already: a reshape to the named shape, a view that
            # legalization keeps as one (``keep_renaming_reshape``), no host step.
            named = self.builder_.emit(relax.op.reshape(plain, target.shape), binding.var.name)
            self.set_var_remap(binding.var, named)
            return
        # Through a rank-only cast: a cast straight from the known shape would bind the new
        # variable to the expression, and Relax's normalizer substitutes it back.
        erased = self.builder_.match_cast(plain, relax.TensorType(ndim=ty.ndim, dtype=ty.dtype),
                                          binding.var.name + "_erased")
        named = self.builder_.match_cast(erased, target, binding.var.name)
        self.set_var_remap(binding.var, named)


def is_renaming_reshape(call: relax.Call) -> bool:
    """``R.reshape`` that only gives dims new names: same rank, each dim equal to the
    input's or a plain variable standing for a computed one (``NameDerivedDims``)."""
    src = call.args[0].ty
    shape = call.args[1]
    if not isinstance(src, relax.TensorType) or not isinstance(src.shape, relax.ShapeExpr) \
            or not isinstance(shape, relax.ShapeExpr) or len(src.shape.values) != len(shape.values):
        return False
    return all(a.same_as(b) or structural_equal(a, b)
               or (isinstance(b, tirx.Var) and not isinstance(a, (tirx.Var, tirx.IntImm))
                   and _has_division(a))
               for a, b in zip(src.shape.values, shape.values))


def keep_renaming_reshape(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """A ``LegalizeOps`` entry for ``relax.reshape``: a renaming reshape stays a reshape
    (lowered to a view, ``vm.builtin.reshape``; TVM's memory planner knows it aliases),
    where TVM's legalization would make a copy kernel that ``RewriteDataflowReshape`` cannot
    prove a reshape (it does not know the name equals the expression); other reshapes are
    legalized as TVM does."""
    if is_renaming_reshape(call):
        return call
    return tvm.ir.Op.get("relax.reshape").get_attr("FLegalize")(bb, call)


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

    Names computed from the parameters' dims alone are defined once, at the function's
    start (a shape bound to a variable, then cast through a rank-only shape); a tensor
    takes them through ``R.reshape`` to the named shape, which ``gpu_legalize_passes``
    keeps a view (``keep_renaming_reshape``), and a reshape to a derived dim names it in its
    target. The casts run on the host before the first kernel, so they do not split the
    graph region (Wav2Vec2: 1 region instead of 18). A dim that needs a value known only
    later (a dim defined by a cast) gets a tensor cast where it appears, as before: a host
    step.

    Before (``samples`` in 400..16000)::

        lv: R.Tensor((1, (samples - 400) // 320 + 1, 32)) = R.permute_dims(conv, [0, 2, 1])
        sm = R.nn.softmax(lv)

    After::

        derived_dims_values: R.Shape([(samples - 400) // 320 + 1]) = R.shape([...])
        derived_dims_erased: R.Shape(ndim=1) = R.match_cast(derived_dims_values, R.Shape(ndim=1))
        derived_dims: R.Shape([dim0]) = R.match_cast(derived_dims_erased, R.Shape([dim0]))
        ...
        lv_derived: R.Tensor((1, (samples - 400) // 320 + 1, 32)) = R.permute_dims(conv, [0, 2, 1])
        lv: R.Tensor((1, dim0, 32)) = R.reshape(lv_derived, R.shape([1, dim0, 32]))
        sm = R.nn.softmax(lv)                # dim0 in 1..49
    """

    def transform_module(self, mod: tvm.IRModule, ctx: PassContext) -> tvm.IRModule:
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            bounds = _bounds(func)
            namer = _Namer(mod, bounds)
            head = namer.hoist(func)
            new = namer.visit_expr(func)
            if not namer.names:
                continue
            if head:
                body = new.body
                first = type(body.blocks[0])(head + list(body.blocks[0].bindings))
                new = relax.Function(new.params, relax.SeqExpr([first, *body.blocks[1:]],
                                                               body.body),
                                     new.ret_ty, new.is_pure, new.attrs, new.span)
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
