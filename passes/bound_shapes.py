"""Declared ranges of symbolic dimensions become TVM's planning bounds."""

from __future__ import annotations

from collections.abc import Mapping

from tvm import IRModule, relax
from tvm.ir.transform import PassContext, module_pass

from grape_tvm.runtime.signature import ShapeRange


def signature_dims(func: relax.Function) -> list[str]:
    """Names of the symbolic dimensions a function's parameters define, in order."""
    names: list[str] = []
    for param in func.params:
        for tir_var in relax.analysis.definable_tir_vars_in_type(param.ty):
            if tir_var.name not in names:
                names.append(tir_var.name)
    return names


@module_pass(opt_level=0, name="BoundShapeRanges")
class BoundShapeRanges:
    """Attach declared dimension ranges to every Relax function that takes those dimensions.

    ``tir_var_upper_bound`` lets ``StaticPlanBlockMemory`` plan every intermediate at the
    bound, so a buffer's address no longer depends on the call's shape: the property a
    captured graph needs. ``tir_var_lower_bound`` is kept beside it for the runtime checks.

    Before (``ranges={"n": ShapeRange(1, 1024)}``)::

        @R.function
        def main(x: R.Tensor(("n", 768), "float32")): ...

    After::

        @R.function
        def main(x: R.Tensor(("n", 768), "float32")):
            R.func_attr({"tir_var_upper_bound": {"n": 1024}, "tir_var_lower_bound": {"n": 1}})

    A range whose name no function signature defines is an error, not a silent no-op.
    """

    def __init__(self, ranges: Mapping[str, ShapeRange | tuple[int, int]]):
        self.ranges = {name: ShapeRange.of(r, name) for name, r in ranges.items()}

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        mod = mod.clone()  # a Python module pass gets the caller's module itself
        seen: set[str] = set()
        for gvar, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            names = [n for n in signature_dims(func) if n in self.ranges]
            if not names:
                continue
            seen.update(names)
            upper = _merged(func, "tir_var_upper_bound", {n: self.ranges[n].hi for n in names})
            lower = _merged(func, "tir_var_lower_bound", {n: self.ranges[n].lo for n in names})
            mod[gvar] = func.with_attr("tir_var_upper_bound", upper).with_attr(
                "tir_var_lower_bound", lower
            )
        unknown = sorted(set(self.ranges) - seen)
        if unknown:
            known = sorted({n for f in mod.functions.values() if isinstance(f, relax.Function)
                            for n in signature_dims(f)})
            raise ValueError(
                f"dimension(s) {unknown} have a declared range but no function takes them; "
                f"the symbolic dimensions of this module are {known or 'none'}"
            )
        return mod


def _merged(func: relax.Function, key: str, new: dict[str, int]) -> dict[str, int]:
    old = {} if func.attrs is None or key not in func.attrs else dict(func.attrs[key])
    return {**{str(k): int(v) for k, v in old.items()}, **new}
