"""The call program: what one call of a compiled model does, written by the compiler.

After memory planning and region lifting, the entry function of a model without host steps
is a straight list: storages (sizes in bytes, expressions of the dims), views of them,
region calls and conditional-region calls (arguments, the dims they are recorded under),
and outputs. ``passes.DescribeCallProgram`` writes that list into the manifest; the
executor evaluates it for a call's dims (``CallProgram.at``) into launches it replays with
no VM. Models with host steps get no program: TVM's VM runs their entry function.

This module is the one definition of the format and of the names the passes and the
runtime share. JSON (``to_json``/``from_json``, version ``FORMAT_VERSION``)::

    {"version": 1,
     "dims":     {"n": [0, 0]},                  # dim -> [input, axis] it is read from
     "derived":  [["m", ["//", "n", 2]]],        # dims computed from others, in order
     "storages": [{"bytes": ["*", 256, "n"]}],
     "views":    [{"storage": 0, "offset": 0, "shape": ["n", 64], "dtype": "float32"},
                  {"input": 0, "offset": 0, "shape": [1, "n", 64], "dtype": "float32"}],
     "steps":    [{"call": "region", "callee": "grape_region_0",
                   "args": [{"input": 0}, {"view": 0}, {"value": "n"}], "dims": ["n"]}],
     "outputs":  [{"view": 0}],
     "conditionals": {"grape_cond_0": {"condition": 0, "dims": ["n"], "branches": [...]}}}

An expression is an int, a dim's name, or ``[op, a, b]`` with op one of ``+ - * // % min
max``. An argument is ``{"input": i}``, ``{"view": j}``, ``{"value": expr}`` (a dim
passed by value) or ``{"shape": [expr]}`` (an output that is a shape).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence, Union

FORMAT_VERSION = 1
# Names the passes give and the runtime looks for.
REGION_ATTR = "grape.region"
REGION_PREFIX = "grape_region_"
CONDITIONAL_ATTR = "grape.conditional"
CONDITIONAL_PREFIX = "grape_cond_"
BRANCHES_ATTR = "grape.branches"  # a conditional region's branches (DescribeConditionals)
PROGRAM_ATTR = "grape.call_program"  # the entry function's program (DescribeCallProgram)
# Guards per region call: the conditionals a region may nest in. The patch kernel's launch
# record has room for this many (topology_graph); a call nested deeper keeps the VM.
MAX_GUARDS = 8

Expr = Union[int, str, list]
_OPS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv,
    "%": operator.mod, "min": min, "max": max}


class ProgramError(ValueError):
    """A call program that does not fit the format (names the field)."""


def evaluate(expr: Expr, dims: Mapping[str, int]) -> int:
    """The value of ``expr`` at ``dims``."""
    if isinstance(expr, bool):
        raise ProgramError(f"expression {expr!r}: not an int, a dim or [op, a, b]")
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str):
        return dims[expr]
    op, a, b = expr
    return _OPS[op](evaluate(a, dims), evaluate(b, dims))


def _check_expr(expr: Expr, where: str, names: set[str]) -> None:
    if isinstance(expr, bool) or not isinstance(expr, (int, str, list)):
        raise ProgramError(f"{where}: {expr!r} is not an expression")
    if isinstance(expr, str) and expr not in names:
        raise ProgramError(f"{where}: dim {expr!r} is not defined before it is used")
    if isinstance(expr, list):
        if len(expr) != 3 or expr[0] not in _OPS:
            raise ProgramError(f"{where}: {expr!r} is not [op, a, b] with op in {sorted(_OPS)}")
        _check_expr(expr[1], where, names)
        _check_expr(expr[2], where, names)


@dataclass(frozen=True)
class Arg:
    """A region argument or an output: ``kind`` input, view, value (an int) or shape."""

    kind: str
    index: int = 0  # the input's or the view's
    value: Any = None  # the expression (program) or its value (``at``)

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> "Arg":
        for kind in ("input", "view"):
            if kind in data:
                return Arg(kind, int(data[kind]))
        if "value" in data:
            return Arg("value", value=data["value"])
        if "shape" in data:
            return Arg("shape", value=list(data["shape"]))
        raise ProgramError(f"argument {data!r}: expected input, view, value or shape")

    def to_json(self) -> dict:
        return {self.kind: self.index if self.kind in ("input", "view") else self.value}

    def at(self, dims: Mapping[str, int]) -> "Arg":
        if self.kind == "value":
            return Arg("value", value=evaluate(self.value, dims))
        if self.kind == "shape":
            return Arg("shape", value=tuple(evaluate(e, dims) for e in self.value))
        return self


@dataclass(frozen=True)
class View:
    """A tensor over a storage (``storage``) or over an input (a reshaped input)."""

    base: str  # "storage" or "input"
    index: int
    offset: Expr
    shape: tuple
    dtype: str


@dataclass(frozen=True)
class Step:
    """A region call, or a conditional region's (both branches launched, guarded)."""

    call: str  # "region" or "conditional"
    callee: str
    args: tuple[Arg, ...]
    dims: tuple


@dataclass(frozen=True)
class Launch:
    """One region launch of a call at fixed dims: its recording's key (``region``,
    ``shape``), its arguments, and guards ``(condition, expect)``: it runs only if each
    condition's byte is ``expect``."""

    region: str
    shape: tuple[int, ...]
    args: tuple[Arg, ...]
    guards: tuple[tuple[Arg, bool], ...] = ()


class ViewAt(NamedTuple):
    """A view at one call's dims: over storage or input ``index``."""

    base: str  # "storage" or "input"
    index: int
    offset: int
    shape: tuple
    dtype: str


@dataclass(frozen=True)
class ProgramAt:
    """The program evaluated at one call's dims."""

    dims: dict
    storage_bytes: tuple[int, ...]
    views: tuple[ViewAt, ...]
    launches: tuple[Launch, ...]
    outputs: tuple[Arg, ...]

    @property
    def guarded(self) -> bool:
        return any(launch.guards for launch in self.launches)


class CallProgram:
    """A model's call program (see the module's docstring for the format)."""

    def __init__(self, dims: Mapping[str, tuple[int, int]], derived: Sequence[tuple[str, Expr]],
                 storages: Sequence[Expr], views: Sequence[View],
                 steps: Sequence[Step], outputs: Sequence[Arg],
                 conditionals: Mapping[str, dict] | None = None):
        self.dims = dict(dims)
        self.derived = list(derived)
        self.storages = list(storages)
        self.views = list(views)
        self.steps = list(steps)
        self.outputs = list(outputs)
        self.conditionals = dict(conditionals or {})
        self.output_storages = frozenset(
            self.views[a.index].index for a in self.outputs
            if a.kind == "view" and self.views[a.index].base == "storage")
        self._check()

    # -- JSON ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        views = [{v.base: v.index, "offset": v.offset, "shape": list(v.shape), "dtype": v.dtype}
                 for v in self.views]
        return {"version": FORMAT_VERSION,
                "dims": {name: list(where) for name, where in self.dims.items()},
                "derived": [[name, expr] for name, expr in self.derived],
                "storages": [{"bytes": size} for size in self.storages],
                "views": views,
                "steps": [{"call": s.call, "callee": s.callee,
                           "args": [a.to_json() for a in s.args], "dims": list(s.dims)}
                          for s in self.steps],
                "outputs": [a.to_json() for a in self.outputs],
                "conditionals": self.conditionals}

    @staticmethod
    def from_plan(plan: Mapping[str, Any]) -> "CallProgram | None":
        """The call program of a compiled plan (the manifest's ``plan``); None for a model
        with host steps or no region (TVM's VM runs its calls), and for artifacts written
        before call programs existed (run the same way)."""
        described = plan.get("call_program")
        if described is None or "error" in described or not plan.get("regions"):
            return None
        return CallProgram.from_json(described)

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> "CallProgram":
        version = data.get("version") if isinstance(data, Mapping) else None
        if version != FORMAT_VERSION:
            raise ProgramError(f"call program version {version!r}; this runtime reads version "
                               f"{FORMAT_VERSION}: compile the model again with this grape-tvm")
        try:
            views = [View("storage" if "storage" in v else "input",
                          int(v["storage"] if "storage" in v else v["input"]),
                          v["offset"], tuple(v["shape"]), str(v["dtype"])) for v in data["views"]]
            steps = [Step(s["call"], s["callee"], tuple(Arg.from_json(a) for a in s["args"]),
                          tuple(s["dims"])) for s in data["steps"]]
            return CallProgram({k: tuple(v) for k, v in data["dims"].items()},
                               [tuple(d) for d in data["derived"]],
                               [s["bytes"] for s in data["storages"]],
                               views, steps, [Arg.from_json(a) for a in data["outputs"]],
                               data.get("conditionals", {}))
        except (KeyError, TypeError) as err:
            raise ProgramError(f"call program: missing or malformed field ({err})") from None

    def _check(self) -> None:
        """Every reference within range and every dim defined before use."""
        names = set(self.dims)
        for name, expr in self.derived:
            _check_expr(expr, f"derived dim {name!r}", names)
            names.add(name)
        for i, size in enumerate(self.storages):
            _check_expr(size, f"storages[{i}].bytes", names)
        for i, view in enumerate(self.views):
            if view.base == "storage" and not 0 <= view.index < len(self.storages):
                raise ProgramError(f"views[{i}] names storage {view.index}, which is not defined")
            for expr in (view.offset, *view.shape):
                _check_expr(expr, f"views[{i}]", names)
        for i, step in enumerate(self.steps):
            if step.call not in ("region", "conditional"):
                raise ProgramError(f"steps[{i}].call is {step.call!r}, expected region or "
                                   "conditional")
            if step.call == "conditional" and step.callee not in self.conditionals:
                raise ProgramError(f"steps[{i}] calls conditional {step.callee!r}, which is "
                                   "not described")
            for expr in step.dims:
                _check_expr(expr, f"steps[{i}].dims", names)
            self._check_args(step.args, f"steps[{i}]", names)
        self._check_args(self.outputs, "outputs", names)

    def _check_args(self, args: Sequence[Arg], where: str, names: set[str]) -> None:
        for arg in args:
            if arg.kind == "view" and not 0 <= arg.index < len(self.views):
                raise ProgramError(f"{where} names view {arg.index}, which is not defined")
            for expr in arg.value if arg.kind == "shape" else \
                    [arg.value] if arg.kind == "value" else []:
                _check_expr(expr, where, names)

    # -- evaluation ------------------------------------------------------------------------
    def dims_of(self, shapes: Sequence[Sequence[int]]) -> dict[str, int]:
        """The program's dims for a call whose inputs have ``shapes``."""
        dims = {name: int(shapes[i][axis]) for name, (i, axis) in self.dims.items()}
        for name, expr in self.derived:
            dims[name] = evaluate(expr, dims)
        return dims

    def at(self, dims: Mapping[str, int]) -> ProgramAt | None:
        """The call at ``dims``: storage sizes, views, launches (conditionals expanded into
        guarded launches); None if a conditional cannot be expanded (nested deeper than
        ``MAX_GUARDS``)."""
        launches: list[Launch] = []
        for step in self.steps:
            args = tuple(a.at(dims) for a in step.args)
            shape = tuple(evaluate(e, dims) for e in step.dims)
            if step.call == "region":
                launches.append(Launch(step.callee, shape, args))
                continue
            calls = guarded_calls(self.conditionals, step.callee, shape, args)
            if calls is None:
                return None
            launches += [Launch(region, region_shape, tuple(region_args), tuple(guards))
                         for region, region_shape, region_args, guards in calls]
        views = tuple(ViewAt(v.base, v.index, evaluate(v.offset, dims),
                             tuple(evaluate(e, dims) for e in v.shape), v.dtype)
                      for v in self.views)
        return ProgramAt(dict(dims), tuple(evaluate(size, dims) for size in self.storages),
                         views, tuple(launches), tuple(a.at(dims) for a in self.outputs))


def guarded_calls(conditionals: Mapping[str, dict], name: str, shape: tuple,
                  args: Sequence[Any], guards: tuple = ()
                  ) -> list[tuple[str, tuple, list, tuple]] | None:
    """The region calls of conditional region ``name`` called with ``args`` at ``shape``:
    ``(region, shape, arguments, guards)`` for both branches, a guard being ``(condition,
    expect)``; a nested conditional adds its own. ``args`` are whatever the caller passes
    (tensors on the VM path, ``Arg``s in a program). None if a conditional is not
    described (``conditionals``, from ``DescribeConditionals``) or a region would need more
    than ``MAX_GUARDS`` guards."""
    described = conditionals.get(name)
    if described is None or len(guards) >= MAX_GUARDS:
        return None
    condition = args[described["condition"]]
    calls = []
    for expect, side in zip((True, False), described["branches"]):
        inner = guards + ((condition, expect),)
        for call in side:
            call_args = [args[i] for i in call["args"]]
            call_shape = tuple(shape[i] for i in call["dims"])
            if call["kind"] == "conditional":
                nested = guarded_calls(conditionals, call["callee"], call_shape, call_args, inner)
                if nested is None:
                    return None
                calls += nested
            else:
                calls.append((call["callee"], call_shape, call_args, inner))
    return calls
