"""A storage that TVM's memory planner shares across an ``if`` is defined before the ``if``."""

from __future__ import annotations

import tvm
from tvm import IRModule, relax
from tvm.ir.transform import PassContext, module_pass

from .lift_regions import seq_bindings, tir_vars

_ALLOC_STORAGE_OPS = {"relax.memory.alloc_storage", "relax.vm.alloc_storage"}

# Where a binding sits: the index of each binding on the way down, and between two indices
# the side of the ``if`` taken: (3, "then", 0) is binding 0 of the then branch of the
# ``if`` bound by binding 3 of the function body. A scope is such a path without its last
# index.
Path = tuple


def _is_alloc_storage(binding: relax.Binding) -> bool:
    value = binding.value
    return isinstance(value, relax.Call) and getattr(value.op, "name", "") in _ALLOC_STORAGE_OPS


class _Places:
    """Where each storage of a function is defined and where it is read."""

    def __init__(self, func: relax.Function):
        self.defs: dict[relax.Var, tuple[Path, relax.Binding]] = {}
        self.uses: dict[relax.Var, list[Path]] = {}
        self._walk(func.body, ())

    def _walk(self, seq: relax.SeqExpr, scope: Path) -> None:
        bindings = seq_bindings(seq)
        for i, binding in enumerate(bindings):
            here = scope + (i,)
            value = binding.value
            if isinstance(value, relax.If):
                self._read(value.cond, here)
                self._walk(value.true_branch, here + ("then",))
                self._walk(value.false_branch, here + ("else",))
                continue
            if _is_alloc_storage(binding):
                self.defs[binding.var] = (here, binding)
            self._read(value, here)
        self._read(seq.body, scope + (len(bindings),))

    def _read(self, expr: relax.Expr, here: Path) -> None:
        for var in relax.analysis.free_vars(expr):
            self.uses.setdefault(var, []).append(here)

    def hoist_point(self, storage: relax.Var) -> Path | None:
        """The path of the binding before which ``storage`` must be defined so that its
        definition precedes every use in an enclosing scope; None where it already does."""
        defined, _ = self.defs[storage]
        best = None
        for use in self.uses.get(storage, []):
            common = 0
            while common < min(len(defined), len(use)) and defined[common] == use[common]:
                common += 1
            if common % 2:
                # Same binding (an ``if``), different branches: before that ``if``.
                point = defined[:common]
            elif common + 1 == len(defined):
                continue  # defined in the use's scope, before it: fine
            else:
                # Defined inside an ``if`` of the use's scope: before that ``if``.
                point = defined[:common + 1]
            if best is None or len(point) < len(best):
                best = point
        return best


@module_pass(opt_level=0, name="HoistBranchStorage")
class HoistBranchStorage:
    """Define before an ``if`` each planned storage used outside the branch defining it.

    Works around a TVM 0.27 bug in ``StaticPlanBlockMemory``: it plans per binding block
    but keeps one pool of free storage per function, and emits each storage's
    ``alloc_storage`` at its first use. A storage first used in the then branch and freed
    there is reused by the else branch, or after the ``if``, where it is not defined: the
    VM reads an unset register and crashes (TVM's default pipeline on
    ``bench/models.py:branch_model``, docs/tvm_onnx_frontend.md). The planner meant one
    storage for all these tensors, sized for the largest (it may grow a reused storage, and
    writes the final size): this pass moves that one ``alloc_storage``, unchanged, to just
    before the outermost ``if`` whose branches or successors use it, where it precedes
    every use. A reuse never reads what the previous tensor left (the planner frees a
    storage only after its last read), so defining it earlier changes no value. Runs right
    after ``StaticPlanBlockMemory`` (``after_memory_planning``); leaves well-formed
    functions alone.

    Before::

        if cond:
            storage = R.memory.alloc_storage(R.shape([16]), 0, "global", "float32")
            alloc = R.memory.alloc_tensor(storage, 0, R.shape([4]), "float32")
            exp(x, alloc)
            ...
        else:
            alloc2 = R.memory.alloc_tensor(storage, 0, R.shape([4]), "float32")  # undefined
            sin(x, alloc2)
            ...

    After::

        storage = R.memory.alloc_storage(R.shape([16]), 0, "global", "float32")
        if cond:
            alloc = R.memory.alloc_tensor(storage, 0, R.shape([4]), "float32")
            exp(x, alloc)
            ...
        else:
            alloc2 = R.memory.alloc_tensor(storage, 0, R.shape([4]), "float32")
            sin(x, alloc2)
            ...
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        out = None
        for gvar, func in mod.functions.items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            new = self._function(gvar.name_hint, func)
            if new is not None:
                out = out or IRModule(dict(mod.functions), attrs=mod.attrs)
                out[gvar] = new
        return mod if out is None else relax.transform.Normalize()(out)

    def _function(self, name: str, func: relax.Function) -> relax.Function | None:
        places = _Places(func)
        moves: dict[Path, list[relax.Binding]] = {}
        removed: set[Path] = set()
        signature = {v for p in func.params for v in relax.analysis.definable_tir_vars_in_type(p.ty)}
        for storage, (defined, binding) in places.defs.items():
            point = places.hoist_point(storage)
            if point is None:
                continue
            local = [v.name for v in tir_vars([binding.value.args[0]]) if v not in signature]
            if local:
                raise ValueError(
                    f"{name}: storage {storage.name} is shared across an if (TVM's memory "
                    f"planner) but its size depends on {local}, defined inside a branch: "
                    "it cannot be defined before the if")
            moves.setdefault(point, []).append(binding)
            removed.add(defined)
        if not moves:
            return None
        body = _rebuild(func.body, (), moves, removed)
        return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def _rebuild(seq: relax.SeqExpr, scope: Path, moves: dict, removed: set) -> relax.SeqExpr:
    blocks, i = [], 0
    for block in seq.blocks:
        bindings = []
        for binding in block.bindings:
            here = scope + (i,)
            i += 1
            bindings += moves.get(here, [])
            if here in removed:
                continue
            value = binding.value
            if isinstance(value, relax.If):
                binding = relax.VarBinding(binding.var, relax.If(
                    value.cond, _rebuild(value.true_branch, here + ("then",), moves, removed),
                    _rebuild(value.false_branch, here + ("else",), moves, removed)))
            bindings.append(binding)
        blocks.append(type(block)(bindings))
    return relax.SeqExpr(blocks, seq.body)


def after_memory_planning(passes: list[tvm.transform.Pass]) -> list[tvm.transform.Pass]:
    """``passes`` (a pipeline's finalize passes) with ``HoistBranchStorage`` right after
    TVM's ``StaticPlanBlockMemory``."""
    names = [p.info.name for p in passes]
    if "StaticPlanBlockMemory" not in names:
        raise ValueError(f"no StaticPlanBlockMemory among {names}")
    at = names.index("StaticPlanBlockMemory") + 1
    return [*passes[:at], HoistBranchStorage(), *passes[at:]]
