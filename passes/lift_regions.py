"""Split a lowered Relax function into graph regions and host steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import json

import tvm
from tvm import IRModule, relax, tirx
from tvm.ir.transform import PassContext, module_pass

from grape_tvm.runtime.call_program import (BRANCHES_ATTR, CONDITIONAL_ATTR, PROGRAM_ATTR,
                                            REGION_ATTR, REGION_PREFIX)
from grape_tvm.runtime.libraries import library_of

from .few_rows_gemv import GEMV_ROWS_ATTR, LIBRARY_FUNCTION_ATTR
from .weight_transpose import TRANSPOSED_INPUTS_ATTR
from .if_to_select import NOTES_ATTR as IF_NOTES_ATTR

# Bindings that do no device work and read no tensor contents: while a region is open they
# are hoisted in front of it (allocations, views, tuples) or sunk behind it (kills), so that
# they do not cut the region in two.
_ALLOC_OPS = {"relax.builtin.alloc_tensor", "relax.memory.alloc_storage", "relax.memory.alloc_tensor",
              "relax.vm.alloc_storage", "relax.vm.alloc_tensor"}
_VIEW_OPS = {"relax.memory.view", "relax.memory.ensure_zero_offset", "relax.null_value",
             # A reshape left after lowering is a view of a contiguous tensor: no kernel.
             "relax.reshape", "vm.builtin.reshape"}
_KILL_OPS = {"relax.memory.kill_tensor", "relax.memory.kill_storage", "relax.vm.kill_object"}
# What VMShapeLower adds to every function: shape checks and shape arithmetic on the host.
_BOOKKEEPING_OPS = {
    "vm.builtin.alloc_shape_heap", "vm.builtin.check_tensor_info", "vm.builtin.check_shape_info",
    "vm.builtin.check_tuple_info", "vm.builtin.check_prim_value_info", "vm.builtin.check_func_info",
    "vm.builtin.match_shape", "vm.builtin.match_prim_value", "vm.builtin.make_shape",
    "vm.builtin.make_prim_value", "vm.builtin.null_value",
}


@dataclass
class HostStep:
    """A binding that stays on the host, and why."""

    function: str
    op: str
    var: str
    reason: str


@dataclass
class RegionInfo:
    """One lifted region: its function and the kernels it launches, in order."""

    name: str
    function: str
    kernels: list[str]
    symbolic_vars: list[str]
    num_params: int


@dataclass
class ConditionalInfo:
    """A conditional region (``BranchesToConditionalRegions``): how it runs, and the
    regions of each branch, in call order (nested conditionals by name)."""

    name: str
    condition: str
    mode: str
    then_calls: list[str]
    else_calls: list[str]
    kernels: int


@dataclass
class GraphPlan:
    """What will run as graphs and what stays on the host, read off a lifted module."""

    regions: list[RegionInfo] = field(default_factory=list)
    host_steps: list[HostStep] = field(default_factory=list)
    host_bookkeeping: int = 0
    conditionals: list[ConditionalInfo] = field(default_factory=list)
    branches: dict = field(default_factory=dict)  # conditional name -> DescribeConditionals' dict
    notes: list[str] = field(default_factory=list)  # what a rewrite left as it was, and why
    # The entry's call program (DescribeCallProgram), or {"error": why it has none}.
    call_program: dict = field(default_factory=lambda: {"error": "not described"})
    # Library matmuls that run on grape's GEMV kernels for few rows (GemvForFewRows): the
    # library function -> the row buckets of its GEMV kernels.
    gemv_rows: dict = field(default_factory=dict)
    # Positions of the inputs the entry takes transposed (StoreWeightsTransposed): the
    # executor transposes each once, as it is bound (``build`` names them in the plan).
    transposed_inputs: list = field(default_factory=list)

    @property
    def libraries(self) -> list[str]:
        """Libraries the runtime must provide for the regions' kernels (``cublaslt``,
        ``attention``)."""
        called = [k for r in self.regions for k in r.kernels] + [h.op for h in self.host_steps]
        return sorted({library_of(k) for k in called} - {None})

    def to_json(self) -> dict:
        return {
            "regions": [vars(r) for r in self.regions],
            "host_steps": [vars(h) for h in self.host_steps],
            "host_bookkeeping": self.host_bookkeeping,
            "conditionals": [vars(c) for c in self.conditionals],
            "branches": self.branches,
            "notes": self.notes,
            "libraries": self.libraries,
            "call_program": self.call_program,
            "gemv_rows": self.gemv_rows,
            "transposed_inputs": self.transposed_inputs,
        }


def _op_name(call: relax.Call) -> str:
    op = call.op
    if isinstance(op, relax.ExternFunc):
        return op.global_symbol
    if isinstance(op, relax.GlobalVar):
        return op.name_hint
    if hasattr(op, "name"):
        name = op.name
        if name in ("relax.call_builtin_with_ctx", "relax.call_pure_packed", "relax.call_packed") and call.args:
            callee = call.args[0]
            if isinstance(callee, relax.ExternFunc):
                return callee.global_symbol
        return name
    return type(op).__name__


def classify(binding: relax.Binding, mod: IRModule) -> tuple[str, str, str]:
    """Return ``(kind, op, reason)``.

    kind is one of kernel, alloc, view, kill, region, conditional (a conditional region's
    call), bookkeeping (VM shape checks) or host.
    """
    value = binding.value
    if isinstance(binding, relax.MatchCast):
        # Binds or checks shapes from values the host already has: a call at given dims
        # always binds the same (NameDerivedDims' derived dims), so it is bookkeeping, not
        # a step that could change which regions run. A data-dependent shape comes from a
        # host op before it, which stays a host step.
        return "bookkeeping", "match_cast", ""
    if isinstance(value, relax.If):
        return "host", "if", "its condition is read on the host"
    if isinstance(value, relax.Call):
        op = value.op
        if isinstance(op, relax.GlobalVar) and op in mod.get_global_vars():
            callee = mod[op]
            if isinstance(callee, tirx.PrimFunc):
                if callee.attrs is not None and callee.attrs.get("tirx.is_host_func", False):
                    return "bookkeeping", op.name_hint, ""
                if callee.attrs is not None and LIBRARY_FUNCTION_ATTR in callee.attrs:
                    # GEMV kernels, or the library above their rows (GemvForFewRows): named
                    # by the library function, which the runtime must provide.
                    return "kernel", str(callee.attrs[LIBRARY_FUNCTION_ATTR]), ""
                return "kernel", op.name_hint, ""
            if callee.attrs is not None and REGION_ATTR in callee.attrs:
                return "region", op.name_hint, ""
            if callee.attrs is not None and CONDITIONAL_ATTR in callee.attrs:
                return "conditional", op.name_hint, ""
            return "host", op.name_hint, "calls a Relax function"
        name = _op_name(value)
        if library_of(name) is not None:
            # A library kernel launched through grape's runtime (cuBLASLt, attention):
            # captured like a PrimFunc's launch.
            return "kernel", name, ""
        if name in _ALLOC_OPS:
            return "alloc", name, ""
        if name in _VIEW_OPS:
            return "view", name, ""
        if name in _KILL_OPS:
            return "kill", name, ""
        if name in _BOOKKEEPING_OPS:
            return "bookkeeping", name, ""
        return "host", name, f"{name} runs on the host"
    if isinstance(value, (relax.Function, relax.SeqExpr)):
        return "host", type(value).__name__, "not a kernel launch"
    # Tuples, tuple items, variables, shapes and constants: values, not work.
    return "view", type(value).__name__, ""


def seq_bindings(seq: relax.SeqExpr) -> list[relax.Binding]:
    """Every binding of a sequence (a function body, a branch), block after block."""
    return [b for block in seq.blocks for b in block.bindings]


def tir_vars(exprs) -> list[tirx.Var]:
    """The symbolic dims of ``exprs``: in their types, and in shapes and values passed."""
    found: dict[str, tirx.Var] = {}
    for expr in exprs:
        for var in relax.analysis.tir_vars_in_type(expr.ty):
            found.setdefault(var.name, var)
        # A dim passed by value is a PrimExpr itself in TVM 0.27 (no PrimValue wrapper).
        values = expr.values if isinstance(expr, relax.ShapeExpr) else \
            [expr] if isinstance(expr.ty, tvm.ir.PrimType) else []
        for value in values:
            for var in tirx.analysis.undefined_vars(value):
                found.setdefault(var.name, var)
    return list(found.values())


class _RegionBuilder:
    """Accumulates one open region while a function's bindings are scanned."""

    def __init__(self):
        self.kernels: list[relax.Binding] = []
        self.hoisted: list[relax.Binding] = []
        self.sunk: list[relax.Binding] = []
        self.defined: set = set()

    def __bool__(self) -> bool:
        return bool(self.kernels)

    def depends_on_region(self, binding: relax.Binding) -> bool:
        return any(v in self.defined for v in relax.analysis.free_vars(binding.value))

    def add_kernel(self, binding: relax.Binding) -> None:
        self.kernels.append(binding)
        self.defined.add(binding.var)

    def lift(self, bb: relax.BlockBuilder, index: int) -> list[relax.Binding]:
        """Emit the region as a function; return the bindings that replace it in the caller."""
        block = relax.BindingBlock(self.kernels)
        params = [v for v in relax.analysis.free_vars(relax.SeqExpr([block], relax.Tuple([])))
                  if not isinstance(v, relax.GlobalVar)]
        sym = tir_vars(params + [a for b in self.kernels for a in b.value.args])
        shape = relax.Var("shape", relax.ShapeType(sym))
        name = f"{REGION_PREFIX}{index}"
        # The region hands its shape back: a call whose result is void crashes TVM 0.27's VM
        # when it returns from a Relax function into the caller's void register.
        func = relax.Function(params + [shape], relax.SeqExpr([block], shape), shape.ty,
                              is_pure=False)
        func = relax.utils.copy_with_new_vars(func)
        func = func.with_attr(REGION_ATTR, index).with_attr("relax.force_pure", True)
        gvar = bb.add_func(func, name)
        call = relax.Call(gvar, params + [relax.ShapeExpr(sym)])
        done = relax.VarBinding(relax.Var(f"{name}_done", relax.ShapeType(sym)), call)
        return [*self.hoisted, done, *self.sunk]


def _used_vars(bindings: list[relax.Binding], body: relax.Expr) -> set:
    """Variables read by ``bindings`` or the function result. Bindings are in SSA form, so a
    kernel whose result var is in this set has its result read after it (on the host)."""
    used = set(relax.analysis.free_vars(body))
    for b in bindings:
        used.update(relax.analysis.free_vars(b.value))
    return used


@module_pass(opt_level=0, name="LiftGraphRegions")
class LiftGraphRegions:
    """Lift each maximal run of kernel launches into its own function: a graph region.

    Runs after memory planning (``StaticPlanBlockMemory``), where every kernel is a direct
    destination-passing call into a PrimFunc. A region's inputs, outputs and intermediates
    are all allocated by the caller, so a region function writes into its arguments and
    returns only its last parameter: a shape holding the symbolic dimensions the region
    uses, the key under which a runtime records the region's launches per shape.
    Allocations, views and kills are moved out of the way; anything else (a branch, a shape
    check, a host builtin) closes the region and stays on the host.

    Before::

        @R.function
        def main(x: R.Tensor(("n", 16), "float32")):
            alloc = R.builtin.alloc_tensor(R.shape([n, 16]), "float32", 0)
            _ = matmul(x, w, alloc)
            alloc1 = R.builtin.alloc_tensor(R.shape([n, 16]), "float32", 0)
            _1 = relu(alloc, alloc1)
            return alloc1

    After::

        @R.function
        def grape_region_0(x, w, alloc, alloc1, shape: R.Shape(["n"])) -> R.Shape(["n"]):
            R.func_attr({"grape.region": 0, "relax.force_pure": True})
            _ = matmul(x, w, alloc)
            _1 = relu(alloc, alloc1)
            return shape

        @R.function
        def main(x: R.Tensor(("n", 16), "float32")):
            alloc = R.builtin.alloc_tensor(R.shape([n, 16]), "float32", 0)
            alloc1 = R.builtin.alloc_tensor(R.shape([n, 16]), "float32", 0)
            grape_region_0_done = grape_region_0(x, w, alloc, alloc1, R.shape([n]))
            return alloc1
    """

    def __init__(self, functions: tuple[str, ...] | None = None):
        self.functions = functions

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        bb = relax.BlockBuilder(mod)
        index = 0
        for gvar, func in list(mod.functions.items()):
            if not self._wanted(gvar, func):
                continue
            new_func, index = self._lift_function(bb, mod, func, index)
            bb.update_func(gvar, new_func)
        return relax.transform.Normalize()(bb.get())

    def _wanted(self, gvar: relax.GlobalVar, func) -> bool:
        if not isinstance(func, relax.Function):
            return False
        if func.attrs is not None and REGION_ATTR in func.attrs:
            return False
        return self.functions is None or gvar.name_hint in self.functions

    def _lift_function(self, bb, mod, func: relax.Function, index: int):
        body = func.body
        if not isinstance(body, relax.SeqExpr):
            return func, index
        blocks = []
        for block in body.blocks:
            bindings, index = self._lift_block(bb, mod, list(block.bindings), body.body, index)
            blocks.append(relax.BindingBlock(bindings))
        new_body = relax.SeqExpr(blocks, body.body)
        return relax.Function(func.params, new_body, func.ret_ty, func.is_pure, func.attrs), index

    def _lift_block(self, bb, mod, bindings, result, index):
        out: list[relax.Binding] = []
        region = _RegionBuilder()
        used = _used_vars(bindings, result)
        for binding in bindings:
            kind, _, _ = classify(binding, mod)
            if kind == "kernel" and binding.var not in used:
                region.add_kernel(binding)
                continue
            if region and kind in ("alloc", "view") and not region.depends_on_region(binding):
                region.hoisted.append(binding)
                continue
            if region and kind == "kill":
                region.sunk.append(binding)
                continue
            if region:
                out += region.lift(bb, index)
                index += 1
                region = _RegionBuilder()
            if isinstance(binding.value, relax.If):
                binding, index = self._lift_branches(bb, mod, binding, index)
            out.append(binding)
        if region:
            out += region.lift(bb, index)
            index += 1
        return out, index


    def _lift_branches(self, bb, mod, binding: relax.Binding, index: int):
        """An ``if`` with the kernels of each branch lifted too (a branch left on the host
        then launches graphs; a conditional region's branches become region calls)."""
        branches = []
        for seq in (binding.value.true_branch, binding.value.false_branch):
            if not isinstance(seq, relax.SeqExpr):
                branches.append(seq)
                continue
            blocks = []
            for block in seq.blocks:
                bindings, index = self._lift_block(bb, mod, list(block.bindings), seq.body, index)
                blocks.append(relax.BindingBlock(bindings))
            branches.append(relax.SeqExpr(blocks, seq.body))
        return relax.VarBinding(binding.var, relax.If(binding.value.cond, *branches)), index


def graph_plan(mod: IRModule, entry: str = "main") -> GraphPlan:
    """Describe a lifted module: its regions in call order (those of conditional regions
    too), its conditional regions, the host steps of ``entry`` with their reasons, and
    notes (``if``s cheap enough for a select that ``IfToSelect`` refused, and why)."""
    plan = GraphPlan()
    func = mod[entry]
    stayed = dict(func.attrs.get("grape.host_branches", {})) if func.attrs is not None else {}
    unselected = dict(func.attrs.get(IF_NOTES_ATTR, {})) if func.attrs is not None else {}
    plan.notes = [f"{entry}.{var}: an if kept, not a select: {why}"
                  for var, why in unselected.items()]
    if func.attrs is not None and TRANSPOSED_INPUTS_ATTR in func.attrs:
        plan.transposed_inputs = [int(i) for i in func.attrs[TRANSPOSED_INPUTS_ATTR]]
    if func.attrs is not None and PROGRAM_ATTR in func.attrs:
        plan.call_program = json.loads(str(func.attrs[PROGRAM_ATTR]))
    plan.gemv_rows = {str(f.attrs[LIBRARY_FUNCTION_ATTR]): [int(b) for b in f.attrs[GEMV_ROWS_ATTR]]
                      for _, f in mod.functions_items()
                      if isinstance(f, tirx.PrimFunc) and f.attrs is not None and
                      GEMV_ROWS_ATTR in f.attrs}
    for block in func.body.blocks:
        for binding in block.bindings:
            kind, op, reason = classify(binding, mod)
            if kind == "region":
                plan.regions.append(_region_info(mod, op))
            elif kind == "conditional":
                _add_conditional(plan, mod, op, binding, entry)
            elif kind == "bookkeeping":
                plan.host_bookkeeping += 1
            elif kind in ("host", "kernel"):
                if isinstance(binding.value, relax.If):
                    why = stayed.get(binding.var.name)
                    launched = _branch_kernels(binding.value, mod)
                    reason += (f" ({why})" if why else "") + \
                        f"; its branches launch {launched} kernel(s)"
                plan.host_steps.append(
                    HostStep(entry, op, binding.var.name, reason or "kernel outside any region"))
    return plan


def _add_conditional(plan: GraphPlan, mod: IRModule, name: str, binding, entry: str) -> int:
    """Add a conditional region (and those nested in it) to ``plan``; its kernel count."""
    func = mod[name]
    described = json.loads(str(func.attrs[BRANCHES_ATTR]))
    if "error" in described:
        plan.host_steps.append(HostStep(
            entry, name, binding.var.name if binding is not None else name,
            f"a conditional region the runtime cannot issue ({described['error']}): "
            "TVM's VM runs it, reading its condition on the host"))
        return 0
    plan.branches[name] = described
    kernels = 0
    sides = []
    for calls in described["branches"]:
        sides.append([c["callee"] for c in calls])
        for call in calls:
            if call["kind"] == "region":
                info = _region_info(mod, call["callee"])
                plan.regions.append(info)
                kernels += len(info.kernels)
            else:
                kernels += _add_conditional(plan, mod, call["callee"], None, entry)
    condition = str(func.attrs.get("grape.condition", ""))
    if not condition:
        condition = binding.value.args[0].name if binding is not None else "(nested)"
    plan.conditionals.append(ConditionalInfo(
        name, condition, "predicated: the regions of both branches launch, each guarded by "
        "the condition; the branch not taken runs nothing", sides[0], sides[1], kernels))
    return kernels


def _region_info(mod: IRModule, name: str) -> RegionInfo:
    func = mod[name]
    kernels = [op for blk in func.body.blocks for b in blk.bindings
               for kind, op, _ in [classify(b, mod)] if kind == "kernel"]
    shape_ty = func.params[-1].ty
    sym = [str(v) for v in shape_ty.values] if shape_ty.values is not None else []
    return RegionInfo(name, name, kernels, sym, len(func.params) - 1)


def _branch_kernels(expr: relax.Expr, mod: IRModule) -> int:
    """Kernel launches inside an If's branches (nested branches and branch regions included)."""
    count = 0
    if isinstance(expr, relax.If):
        return _branch_kernels(expr.true_branch, mod) + _branch_kernels(expr.false_branch, mod)
    if isinstance(expr, relax.SeqExpr):
        for block in expr.blocks:
            for binding in block.bindings:
                kind, op, _ = classify(binding, mod)
                count += kind == "kernel"
                if kind == "region":  # a branch's kernels lifted into a graph region
                    count += len(_region_info(mod, op).kernels)
                count += _branch_kernels(binding.value, mod)
    return count
