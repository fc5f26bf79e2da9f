"""Write the entry function's call program (``runtime.call_program``) as its attribute."""

from __future__ import annotations

import json

import tvm
from tvm import IRModule, relax, tirx
from tvm.ir.transform import PassContext, module_pass

from grape_tvm.runtime.call_program import BRANCHES_ATTR, PROGRAM_ATTR, CallProgram, Arg, Step, View

from .lift_regions import classify, seq_bindings

_BINARY = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.FloorDiv: "//",
           tirx.FloorMod: "%", tirx.Min: "min", tirx.Max: "max"}
_ALLOC_STORAGE = "relax.memory.alloc_storage"
_ALLOC_TENSOR = "relax.memory.alloc_tensor"
_RESHAPES = ("relax.reshape", "vm.builtin.reshape")


def _is_prim(expr) -> bool:
    """A TIR expression (TVM 0.27 has no common PrimExpr class: its type says)."""
    return isinstance(getattr(expr, "ty", None), tvm.ir.PrimType)


class NotAProgram(ValueError):
    """The entry function is not a straight list of storages, views and region calls."""


def prim_expr(expr: tirx.PrimExpr) -> int | str | list:
    """``expr`` in the program's expression form (``runtime.call_program``)."""
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        return expr.name
    if isinstance(expr, tirx.Cast) and "int" in str(expr.ty):
        return prim_expr(expr.value)
    for kind, op in _BINARY.items():
        if isinstance(expr, kind):
            return [op, prim_expr(expr.a), prim_expr(expr.b)]
    raise NotAProgram(f"the shape expression {expr} ({type(expr).__name__}) has no form in "
                      "the call program")


class _Builder:
    """Reads ``main``'s bindings in order into a ``CallProgram``."""

    def __init__(self, func: relax.Function, mod: IRModule):
        self.params = list(func.params)
        self.dims: dict[str, tuple[int, int]] = {}
        for i, param in enumerate(self.params):
            shape = getattr(param.ty, "shape", None)
            if not isinstance(param.ty, relax.TensorType) or not isinstance(shape, relax.ShapeExpr):
                raise NotAProgram(f"input {param.name} is not a tensor of known rank")
            for axis, value in enumerate(shape.values):
                if isinstance(value, tirx.Var):
                    self.dims.setdefault(value.name, (i, axis))
        self.derived: list[tuple[str, object]] = []
        self.storages: list[object] = []  # sizes in bytes
        self.views: list[View] = []
        self.steps: list[Step] = []
        self.storage_of: dict[relax.Var, int] = {}
        self.value_of: dict[relax.Var, object] = {p: Arg("input", i) for i, p in enumerate(self.params)}
        self.conditionals: dict[str, dict] = {}

    def defined(self) -> set[str]:
        return set(self.dims) | {name for name, _ in self.derived}

    def build(self, func: relax.Function, mod: IRModule) -> CallProgram:
        for binding in seq_bindings(func.body):
            self.bind(binding, mod)
        return CallProgram(self.dims, self.derived, self.storages, self.views, self.steps,
                           self.outputs(func.body.body), self.conditionals)

    def bind(self, binding: relax.Binding, mod: IRModule) -> None:
        var, value = binding.var, binding.value
        if isinstance(binding, relax.MatchCast):
            self.match_cast(binding)
            return
        kind, op, reason = classify(binding, mod)
        if kind == "kill":
            return
        if kind in ("region", "conditional"):
            self.call(kind, op, value, mod)
            return
        if isinstance(value, relax.Call) and op == _ALLOC_STORAGE:
            size = value.args[0]
            if not isinstance(size, relax.ShapeExpr) or len(size.values) != 1:
                raise NotAProgram(f"{var.name}: a storage of size {size}")
            self.storage_of[var] = len(self.storages)
            self.storages.append(prim_expr(size.values[0]))
            return
        if isinstance(value, relax.Call) and op == _ALLOC_TENSOR:
            storage, offset, shape = value.args[:3]
            if storage not in self.storage_of or not _is_prim(offset):
                raise NotAProgram(f"{var.name}: a tensor in {storage}")
            self.view(var, View("storage", self.storage_of[storage], prim_expr(offset),
                                self.shape(shape, var), str(var.ty.dtype)))
            return
        if isinstance(value, relax.Call) and op in _RESHAPES:
            self.reshape(var, value)
            return
        if isinstance(value, relax.Tuple):
            self.value_of[var] = [self.arg(f) for f in value.fields]
            return
        if isinstance(value, relax.TupleGetItem) and isinstance(self.value_of.get(value.tuple_value), list):
            self.value_of[var] = self.value_of[value.tuple_value][value.index]
            return
        if isinstance(value, relax.Var) and value in self.value_of:
            self.value_of[var] = self.value_of[value]
            return
        if isinstance(value, relax.ShapeExpr):
            # A shape bound to a variable (NameDerivedDims' derived dims, cast by a match_cast
            # after it): its values, for what reads it.
            self.value_of[var] = Arg("shape", value=[prim_expr(v) for v in value.values])
            return
        raise NotAProgram(f"{var.name} = {op}: {reason or kind} (a host step)")

    def shape(self, shape: relax.Expr, var: relax.Var) -> tuple:
        if not isinstance(shape, relax.ShapeExpr):
            raise NotAProgram(f"{var.name}: a shape that is not known ({shape})")
        return tuple(prim_expr(v) for v in shape.values)

    def view(self, var: relax.Var, view: View) -> None:
        self.value_of[var] = Arg("view", len(self.views))
        self.views.append(view)

    def reshape(self, var: relax.Var, call: relax.Call) -> None:
        source = self.value_of.get(call.args[0])
        dtype = str(var.ty.dtype)
        shape = self.shape(call.args[1], var)
        if isinstance(source, Arg) and source.kind == "view":
            base = self.views[source.index]
            self.view(var, View(base.base, base.index, base.offset, shape, dtype))
        elif isinstance(source, Arg) and source.kind == "input":
            self.view(var, View("input", source.index, 0, shape, dtype))
        else:
            raise NotAProgram(f"{var.name}: a reshape of {call.args[0]}")

    def match_cast(self, binding: relax.MatchCast) -> None:
        """A cast defining dims from values known at these dims (``NameDerivedDims``)."""
        pattern = binding.ty
        source = binding.value
        if isinstance(source, relax.Var) and source in self.value_of:
            known = self.value_of[source]
            if isinstance(known, Arg) and known.kind == "view":
                values = self.views[known.index].shape
            elif isinstance(known, Arg) and known.kind == "shape":
                values = tuple(known.value)
            elif isinstance(known, Arg) and known.kind == "input":
                values = self.shape(self.params[known.index].ty.shape, source)
            else:
                raise NotAProgram(f"{binding.var.name}: a cast of {source}")
        elif isinstance(source, relax.ShapeExpr):
            values = tuple(prim_expr(v) for v in source.values)
        else:
            raise NotAProgram(f"{binding.var.name}: a cast of {source}")
        target = getattr(pattern, "shape", None) if isinstance(pattern, relax.TensorType) else \
            pattern if isinstance(pattern, relax.ShapeType) else None
        target_values = getattr(target, "values", None)
        if target_values is None:
            if isinstance(pattern, relax.ShapeType) and pattern.ndim == len(values):
                # A rank-only cast (NameDerivedDims erases the values before it names
                # them): the values pass through to the cast that names them.
                self.value_of[binding.var] = Arg("shape", value=list(values))
                return
            raise NotAProgram(f"{binding.var.name}: a cast to {pattern} (rank unknown)")
        for value, expr in zip(target_values, values):
            if isinstance(value, tirx.Var) and value.name not in self.defined():
                self.derived.append((value.name, expr))
        if isinstance(pattern, relax.ShapeType):
            self.value_of[binding.var] = Arg("shape", value=[prim_expr(v) for v in target_values])
        else:
            self.value_of[binding.var] = self.value_of[source]

    def arg(self, expr: relax.Expr) -> Arg:
        if isinstance(expr, relax.Var) and isinstance(self.value_of.get(expr), Arg):
            return self.value_of[expr]
        if _is_prim(expr):  # a dim passed by value (TVM 0.27: no wrapper)
            return Arg("value", value=prim_expr(expr))
        if isinstance(expr, relax.ShapeExpr):
            return Arg("shape", value=[prim_expr(v) for v in expr.values])
        raise NotAProgram(f"an argument the program cannot name: {expr}")

    def call(self, kind: str, callee: str, call: relax.Call, mod: IRModule) -> None:
        *args, shape = call.args
        if kind == "conditional":
            described = json.loads(str(mod[callee].attrs[BRANCHES_ATTR]))
            if "error" in described:
                raise NotAProgram(f"conditional region {callee} is run by the VM: "
                                  f"{described['error']}")
            self._add_conditional(callee, described, mod)
        self.steps.append(Step(kind, callee, tuple(self.arg(a) for a in args),
                               tuple(prim_expr(v) for v in shape.values)))

    def _add_conditional(self, name: str, described: dict, mod: IRModule) -> None:
        self.conditionals[name] = described
        for branch in described["branches"]:
            for inner in branch:
                if inner["kind"] == "conditional" and inner["callee"] not in self.conditionals:
                    nested = json.loads(str(mod[inner["callee"]].attrs[BRANCHES_ATTR]))
                    if "error" in nested:
                        raise NotAProgram(f"conditional region {inner['callee']} is run by "
                                          f"the VM: {nested['error']}")
                    self._add_conditional(inner["callee"], nested, mod)

    def outputs(self, body: relax.Expr) -> list[Arg]:
        if isinstance(body, relax.Tuple):
            return [self.arg(f) for f in body.fields]
        if isinstance(body, relax.Var) and isinstance(self.value_of.get(body), list):
            return list(self.value_of[body])
        if isinstance(body, relax.ShapeExpr):
            return [Arg("shape", value=[prim_expr(v) for v in body.values])]
        return [self.arg(body)]


def describe_call_program(func: relax.Function, mod: IRModule) -> dict:
    """``func``'s call program as JSON, or ``{"error": why}`` when it has host steps."""
    try:
        program = _Builder(func, mod).build(func, mod)
    except NotAProgram as err:
        return {"error": str(err)}
    return program.to_json()


@module_pass(opt_level=0, name="DescribeCallProgram")
class DescribeCallProgram:
    """Write the entry function's call program into its ``grape.call_program`` attribute.

    Runs after ``LiftGraphRegions``, ``DescribeConditionals``, ``LowerAllocTensor`` and
    ``KillAfterLastUse``, while storages, views and region calls are still plain bindings
    (``VMShapeLower`` then turns them into VM bookkeeping). The runtime evaluates the
    program for a call's dims and replays the regions without TVM's VM.

    Before (``main`` after lifting)::

        @R.function
        def main(x: R.Tensor(("n", 64), "float32")):
            storage = R.memory.alloc_storage(R.shape([262144]), 0, "global", "float32")
            alloc = R.memory.alloc_tensor(storage, 0, R.shape([n, 64]), "float32", 0)
            storage1 = R.memory.alloc_storage(R.shape([4 * n * 64]), 0, "global", "uint8")
            alloc1 = R.memory.alloc_tensor(storage1, 0, R.shape([n, 64]), "float32", 0)
            _ = grape_region_0(x, alloc, alloc1, R.shape([n]))
            return alloc1

    After: the same function, with the attribute (JSON)::

        {"version": 1, "dims": {"n": [0, 0]}, "derived": [],
         "storages": [{"bytes": 262144}, {"bytes": ["*", ["*", 4, "n"], 64]}],
         "views": [{"storage": 0, "offset": 0, "shape": ["n", 64], "dtype": "float32"},
                   {"storage": 1, "offset": 0, "shape": ["n", 64], "dtype": "float32"}],
         "steps": [{"call": "region", "callee": "grape_region_0",
                    "args": [{"input": 0}, {"view": 0}, {"view": 1}], "dims": ["n"]}],
         "outputs": [{"view": 1}], "conditionals": {}}

    A function with a host step gets ``{"error": why}``: TVM's VM runs it.
    """

    def __init__(self, entry: str = "main"):
        self.entry = entry

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        gvar = mod.get_global_var(self.entry)
        func = mod[gvar]
        described = describe_call_program(func, mod)
        mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else mod
        mod[gvar] = func.with_attr(PROGRAM_ATTR, json.dumps(described))
        return mod
