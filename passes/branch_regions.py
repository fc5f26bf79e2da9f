"""Data-dependent branches as conditional regions: no host read of the condition."""

from __future__ import annotations

import json

from tvm import IRModule, relax
from tvm.ir.transform import PassContext, module_pass

from grape_tvm.runtime.call_program import (BRANCHES_ATTR, CONDITIONAL_ATTR, CONDITIONAL_PREFIX,
                                            REGION_ATTR)

from .lift_regions import classify, seq_bindings, tir_vars

HOST_BRANCHES_ATTR = "grape.host_branches"  # on the caller: If var -> why it stayed on the host
CONDITION_NAME_ATTR = "grape.condition"  # on a conditional function: its condition's name

_ALLOC_TENSOR_OPS = {"relax.builtin.alloc_tensor", "relax.memory.alloc_tensor"}


@relax.expr_functor.mutator
class _Substitute(relax.PyExprMutator):
    """Replace variables by expressions (a branch's buffers by the caller's)."""

    def __init__(self, mapping: dict):
        super().__init__()
        self.mapping = mapping

    def visit_var_(self, op: relax.Var) -> relax.Expr:
        return self.mapping.get(op, op)


def _op_name(value: relax.Expr) -> str:
    return getattr(getattr(value, "op", None), "name", "") if isinstance(value, relax.Call) else ""


class _Branch:
    """One side of an ``if``: what moves to the caller (allocations, views, kills), the
    device work that stays (kernels, nested conditional regions) and the buffers it returns
    (one, or one per field of a tuple)."""

    def __init__(self, side: str, seq: relax.Expr, mod: IRModule, made: set):
        self.side = side
        self.made = made  # conditional functions made by this pass run (not in ``mod`` yet)
        self.hoisted: list[relax.Binding] = []
        self.sunk: list[relax.Binding] = []
        self.work: list[relax.Binding] = []
        self.renames: dict[relax.Var, relax.Var] = {}
        self.results: list[relax.Var] = []
        self.reason = self._split(seq, mod) if isinstance(seq, relax.SeqExpr) else \
            f"the {side} branch is not a sequence of bindings"

    def _split(self, seq: relax.SeqExpr, mod: IRModule) -> str:
        bindings = seq_bindings(seq)
        for b in bindings:  # x = y: a renaming, resolved to the variable it names
            if isinstance(b, relax.VarBinding) and isinstance(b.value, relax.Var):
                self.renames[b.var] = self.renames.get(b.value, b.value)
        result = self.renames.get(seq.body, seq.body)
        tuples = {b.var: b.value for b in bindings if isinstance(b.value, relax.Tuple)}
        fields = tuples[result].fields if result in tuples else \
            result.fields if isinstance(result, relax.Tuple) else [result]
        self.results = [self.renames.get(f, f) for f in fields]
        allocated = {b.var for b in bindings if _op_name(b.value) in _ALLOC_TENSOR_OPS}
        for value in self.results:
            if value not in allocated:
                return (f"the {self.side} branch returns {value}, not a buffer it writes "
                        "(it would need a copy)")
        if len(set(self.results)) != len(self.results):
            return f"the {self.side} branch returns one buffer twice"
        for b in bindings:
            if b.var in self.renames or b.var in self.results or \
                    (b.var.same_as(result) and result in tuples):
                continue
            made = isinstance(b.value, relax.Call) and b.value.op in self.made
            kind, op, _ = ("conditional", "", "") if made else classify(b, mod)
            if kind in ("alloc", "view"):
                self.hoisted.append(b)
            elif kind == "kill":
                self.sunk.append(b)
            elif kind in ("kernel", "conditional"):
                self.work.append(b)
            else:
                return f"the {self.side} branch has a host step ({op})"
        return "" if self.work else f"the {self.side} branch launches no kernel"

    def substituted(self, bindings: list[relax.Binding],
                    outs: list[relax.Var]) -> list[relax.Binding]:
        """``bindings`` with the branch's renamings and its result buffers replaced by
        ``outs``, the caller's."""
        mapping = {**self.renames, **dict(zip(self.results, outs))}
        mutator = _Substitute(mapping)
        return [relax.VarBinding(b.var, mutator.visit_expr(b.value)) for b in bindings]


def _result_types(var: relax.Var) -> list[relax.TensorType] | None:
    """The tensors an ``if`` returns (one, or a tuple's fields), each of known shape."""
    ty = var.ty
    fields = list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]
    if all(isinstance(f, relax.TensorType) and isinstance(f.shape, relax.ShapeExpr)
           for f in fields):
        return fields
    return None


@module_pass(opt_level=0, name="BranchesToConditionalRegions")
class BranchesToConditionalRegions:
    """Turn an ``if`` on a device tensor into a call of a conditional region.

    Runs after memory planning, where a branch is allocations and destination-passing
    kernel calls. Both branches then write one buffer that the caller allocates; their
    allocations move to the caller too, so a branch is device work on the caller's
    buffers only. The conditional function keeps the ``if`` (TVM's VM, the fallback, reads
    the condition), and a runtime that knows its branches (``DescribeConditionals``) runs
    both, each guarded on the device by the condition: no host read of it, no graph split.
    Nested branches are converted inside out. An ``if`` stays on the host when a branch
    returns a value it did not write (an input, say: that would need a copy), has a host
    step, or launches nothing, or when the result is not tensors of known shape (one, or a
    tuple of them); the reason is kept in the caller's ``grape.host_branches`` attribute.

    Before::

        if cond:
            alloc1 = R.builtin.alloc_tensor(R.shape([n, 16]), "float32", 0)
            relu(h, alloc1)
            r = alloc1
        else:
            alloc2 = R.builtin.alloc_tensor(R.shape([n, 16]), "float32", 0)
            tmp = R.builtin.alloc_tensor(R.shape([n, 16]), "float32", 0)
            exp(h, tmp)
            multiply(tmp, h, alloc2)
            r = alloc2

    After::

        r = R.builtin.alloc_tensor(R.shape([n, 16]), "float32", 0)
        tmp = R.builtin.alloc_tensor(R.shape([n, 16]), "float32", 0)
        grape_cond_0_done = grape_cond_0(cond, h, r, tmp, R.shape([n]))

        @R.function
        def grape_cond_0(cond, h, r, tmp, shape: R.Shape(["n"])) -> R.Shape(["n"]):
            R.func_attr({"grape.conditional": 0, "relax.force_pure": True})
            done = (if cond: relu(h, r); shape
                    else: exp(h, tmp); multiply(tmp, h, r); shape)
            return shape
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        self._mod, self._bb, self._index = mod, relax.BlockBuilder(mod), 0
        self._made: set = set()
        for gvar, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            if func.attrs is not None and (REGION_ATTR in func.attrs or CONDITIONAL_ATTR in func.attrs):
                continue
            self._stayed: dict[str, str] = {}
            body = self._seq(func.body)
            if body is func.body:
                continue
            attrs = dict(func.attrs) if func.attrs is not None else {}
            if self._stayed:
                attrs[HOST_BRANCHES_ATTR] = self._stayed
            new = relax.Function(func.params, body, func.ret_ty, func.is_pure)
            self._bb.update_func(gvar, new.with_attrs(attrs) if attrs else new)
        return relax.transform.Normalize()(self._bb.get())

    def _seq(self, seq: relax.SeqExpr) -> relax.SeqExpr:
        changed = False
        blocks = []
        for block in seq.blocks:
            bindings = []
            for binding in block.bindings:
                new = self._binding(binding)
                changed |= new is not None
                bindings += new if new is not None else [binding]
            blocks.append(relax.BindingBlock(bindings))
        return relax.SeqExpr(blocks, seq.body) if changed else seq

    def _binding(self, binding: relax.Binding) -> list[relax.Binding] | None:
        """The bindings replacing an ``if`` (None: unchanged)."""
        value = binding.value
        if not isinstance(value, relax.If):
            return None
        # Inside out: nested branches first, so that they are work of this one.
        true_seq = self._seq(value.true_branch) if isinstance(value.true_branch, relax.SeqExpr) \
            else value.true_branch
        false_seq = self._seq(value.false_branch) if isinstance(value.false_branch, relax.SeqExpr) \
            else value.false_branch
        branches = [_Branch("then", true_seq, self._mod, self._made),
                    _Branch("else", false_seq, self._mod, self._made)]
        types = _result_types(binding.var)
        cond_ty = value.cond.ty
        if not (isinstance(cond_ty, relax.TensorType) and cond_ty.ndim == 0
                and str(cond_ty.dtype) == "bool"):
            # The patch kernel reads a condition as one byte of device memory.
            reason = f"its condition is {cond_ty}, not a 0-d bool tensor"
        elif types is None:
            reason = f"its result is {binding.var.ty}, not tensors of known shape"
        else:
            reason = next((b.reason for b in branches if b.reason), "")
        if reason:
            self._stayed[binding.var.name] = reason
            if true_seq is value.true_branch and false_seq is value.false_branch:
                return None
            return [relax.VarBinding(binding.var, relax.If(value.cond, true_seq, false_seq))]
        return self._conditional(binding.var, value.cond, types, branches)

    def _conditional(self, result: relax.Var, cond: relax.Expr, types: list[relax.TensorType],
                     branches: list[_Branch]) -> list[relax.Binding]:
        # The caller's buffers, one per result tensor: the if's own variable for a tensor,
        # one per field (and the tuple of them) for a tuple.
        tupled = isinstance(result.ty, relax.TupleType)
        outs = [relax.Var(f"{result.name}_{i}", ty) for i, ty in enumerate(types)] \
            if tupled else [result]
        allocs = [relax.VarBinding(out, relax.op.builtin.alloc_tensor(ty.shape, str(ty.dtype), 0))
                  for out, ty in zip(outs, types)]
        if tupled:
            allocs.append(relax.VarBinding(result, relax.Tuple(outs)))
        work = [b.substituted(b.work, outs) for b in branches]
        hoisted = [h for b in branches for h in b.substituted(b.hoisted, outs)]
        sunk = [s for b in branches for s in b.sunk]
        # The condition first, then what the branches read and write (free_vars: each once).
        seqs = [relax.SeqExpr([relax.BindingBlock(w)], relax.Tuple([])) for w in work]
        params = [cond] + [v for v in relax.analysis.free_vars(relax.Tuple(seqs))
                           if not isinstance(v, relax.GlobalVar) and not v.same_as(cond)]
        sym = tir_vars(params + [a for w in work for b in w for a in getattr(b.value, "args", [])])
        shape_param = relax.Var("shape", relax.ShapeType(sym))
        done = relax.Var("done", relax.ShapeType(sym))
        branch_if = relax.If(cond, *[relax.SeqExpr([relax.BindingBlock(w)], shape_param)
                                     for w in work])
        body = relax.SeqExpr([relax.BindingBlock([relax.VarBinding(done, branch_if)])], shape_param)
        func = relax.Function(params + [shape_param], body, shape_param.ty, is_pure=False)
        func = relax.utils.copy_with_new_vars(func)
        func = func.with_attr(CONDITIONAL_ATTR, self._index).with_attr("relax.force_pure", True)
        # The condition's name as the model has it (lowering renames it after an allocation).
        func = func.with_attr(CONDITION_NAME_ATTR, getattr(cond, "name", str(cond)))
        name = f"{CONDITIONAL_PREFIX}{self._index}"
        self._index += 1
        gvar = self._bb.add_func(func, name)
        self._made.add(gvar)
        call = relax.Call(gvar, params + [relax.ShapeExpr(sym)])
        called = relax.VarBinding(relax.Var(f"{name}_done", relax.ShapeType(sym)), call)
        return [*allocs, *hoisted, called, *sunk]


@module_pass(opt_level=0, name="DescribeConditionals")
class DescribeConditionals:
    """Write down, on each conditional function, what its branches call and with what.

    Runs after ``LiftGraphRegions``, where a branch of a conditional region is a sequence of
    region calls and nested conditional calls on the conditional's own parameters. A
    runtime reads this (``grape.branches``, JSON) to issue both branches itself, guarded by
    the condition, without TVM's VM; the compiled VM code no longer shows it plainly.

    For ``grape_cond_0(cond, h, r, tmp, shape: R.Shape(["n"]))`` whose else branch calls
    ``grape_region_2(tmp, h, r, R.shape([n]))``::

        {"condition": 0, "branches": [[...], [{"callee": "grape_region_2",
         "args": [3, 1, 2], "dims": [0]}]]}

    ``args`` index the conditional's parameters, ``dims`` its shape's values. A branch
    that is not only such calls gets ``{"error": why}``: the conditional then stays a
    host step (``graph_plan``), run by the VM.
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        bb = relax.BlockBuilder(mod)
        changed = False
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function) and func.attrs is not None and \
                    CONDITIONAL_ATTR in func.attrs:
                try:
                    described = describe(func, mod)
                except ValueError as err:
                    # Not a sequence of region calls: the runtime cannot issue it, so the
                    # VM runs it (reading the condition), and the plan says why.
                    described = {"error": str(err)}
                bb.update_func(gvar, func.with_attr(BRANCHES_ATTR, json.dumps(described)))
                changed = True
        return bb.get() if changed else mod


def describe(func: relax.Function, mod: IRModule) -> dict:
    """The branches of a lifted conditional function (see ``DescribeConditionals``)."""
    params = list(func.params[:-1])
    dims = [str(v) for v in func.params[-1].ty.values]
    branch_if = seq_bindings(func.body)[0].value
    branches = []
    for seq in (branch_if.true_branch, branch_if.false_branch):
        calls = []
        for b in seq_bindings(seq):
            kind, op, _ = classify(b, mod)
            if kind not in ("region", "conditional"):
                raise ValueError(f"a branch holds {op} ({kind}), not only region calls")
            *args, shape = b.value.args
            calls.append({"callee": op, "kind": kind,
                          "args": [_index_of(a, params, op) for a in args],
                          "dims": [dims.index(str(v)) for v in shape.values]})
        branches.append(calls)
    return {"condition": 0, "dims": dims, "branches": branches}


def _index_of(arg: relax.Expr, params: list[relax.Var], callee: str) -> int:
    for i, p in enumerate(params):
        if arg.same_as(p):
            return i
    raise ValueError(f"{callee} is called with {arg}, which is not a parameter of its "
                     "conditional region")
