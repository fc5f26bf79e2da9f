"""ONNX node conformance: every onnx backend node test case, through TVM's Relax path and grape's.

    python -m grape_tvm.conformance [--limit N] [--filter SUBSTR ...] [--case NAME ...]
                                    [--jobs 2] [--timeout 60] --json FILE

The ``onnx`` wheel no longer ships the node test data: the cases are made by onnx's own
generators (``onnx.backend.test.case.node.collect_testcases()``), each a one-node model (or
its function expansion, ``*_expanded``) with input and expected output arrays. Every case
runs on the CPU two ways:

* ``tvm``: TVM's Relax path as a new user takes it: ``relax.frontend.onnx.from_onnx(model)``,
  ``tvm.compile(mod, target={"kind": "llvm"})``, ``relax.VirtualMachine(ex, tvm.cpu())``;
* ``grape``: ``grape_tvm.compile_onnx(model, dims, "llvm")``, ``.export``, ``grape_tvm.load``,
  ``.run``.

Outputs are compared with the expected ones as onnx's backend runner does: same count,
shape and dtype; floats with the case's ``rtol``/``atol`` (NaN equal to NaN); bool, integer
and string outputs exactly. Half-precision outputs off the expected ones but equal to
onnxruntime's (CPU, same tolerance) pass, listed apart (``*_matches_onnxruntime_only``): the suite's
expected half-precision outputs are numpy's roundings, which onnxruntime itself misses by
an ulp. Each path of each case runs in a worker process with a
timeout: a compile that hangs or a kernel that crashes the process becomes a failure
reason, and the worker is replaced. Every failure has a one-line reason naming the operator
and the cause; reasons are grouped into categories for the summary.

The parent process imports neither TVM nor grape's compiler: only onnx (to make the cases).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import numpy as np

PATHS = ("tvm", "grape")
DEFAULT_RTOL, DEFAULT_ATOL = 1e-3, 1e-5  # only where a case carries no tolerance
RECYCLE_AFTER = 200  # tasks per worker before a fresh one (TVM modules pile up)


# -- cases ---------------------------------------------------------------------------------
@dataclass
class Case:
    """One node test case, in a form that crosses a process boundary (pickle)."""

    name: str
    op: str
    model: bytes  # ModelProto.SerializeToString()
    inputs: list[Any]  # numpy arrays, lists of them (sequences) or None (absent optional)
    outputs: list[Any]
    rtol: float
    atol: float


def _normalize(value: Any) -> Any:
    """numpy arrays from what onnx's generators store (TensorProto, numpy scalars, lists)."""
    import onnx  # pylint: disable=import-outside-toplevel
    from onnx import numpy_helper  # pylint: disable=import-outside-toplevel

    if value is None:
        return None
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    return np.asarray(value)


def _op_of(name: str, existing: dict) -> str:
    base = re.sub(r"_expanded(_ver\d+)?$", "", name)
    node = existing.get(base) or existing.get(name)
    return node.op_type if node is not None else base.removeprefix("test_")


def collect_cases(filters: list[str] | None = None, limit: int | None = None,
                  names: list[str] | None = None) -> list[Case]:
    """onnx's node test cases sorted by name: those named in ``names`` or whose name
    contains one of ``filters`` (case-insensitive) or whose operator is one of them (all
    when neither is given), the first ``limit`` of them."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        from onnx.backend.test.case import node  # pylint: disable=import-outside-toplevel

        found = node.collect_testcases()
    existing = dict(getattr(node, "_existing_names", {}))
    wanted = [f.lower() for f in filters or [] if f]
    exact = set(names or [])
    unknown = sorted(exact - {t.name for t in found})
    if unknown:
        raise ValueError(f"no node test case named {unknown}")
    cases = []
    for test in sorted(found, key=lambda t: t.name):
        op = _op_of(test.name, existing)
        if (wanted or exact) and test.name not in exact and \
                not any(w in test.name.lower() or w == op.lower() for w in wanted):
            continue
        inputs, outputs = test.data_sets[0]
        cases.append(Case(test.name, op, test.model.SerializeToString(),
                          [_normalize(v) for v in inputs], [_normalize(v) for v in outputs],
                          float(test.rtol if test.rtol is not None else DEFAULT_RTOL),
                          float(test.atol if test.atol is not None else DEFAULT_ATOL)))
        if limit is not None and len(cases) >= limit:
            break
    return cases


# -- comparing outputs -------------------------------------------------------------------------
def _as_float(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64)


def compare(outputs: list[Any], expected: list[Any], rtol: float, atol: float,
            names: list[str] | None = None) -> str | None:
    """None when ``outputs`` match ``expected``, else why not (one line)."""
    if len(outputs) != len(expected):
        return f"wrong result: {len(outputs)} output(s), expected {len(expected)}"
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        label = f"output {names[i]!r}" if names and i < len(names) else f"output {i}"
        if isinstance(ref, list):
            if not isinstance(out, list):
                return f"wrong result: {label} is {type(out).__name__}, expected a sequence"
            why = compare(out, ref, rtol, atol)
            if why:
                return why.replace("wrong result: ", f"wrong result: {label} ", 1)
            continue
        if ref is None:
            if out is not None:
                return f"wrong result: {label} has a value, expected none"
            continue
        out = np.asarray(out)
        if out.shape != ref.shape:
            return f"wrong result: {label} shape {out.shape}, expected {ref.shape}"
        if out.dtype != ref.dtype:
            return f"wrong result: {label} dtype {out.dtype}, expected {ref.dtype}"
        kind = ref.dtype.kind
        if kind in "biuUSO":
            if not np.array_equal(out, ref):
                bad = int(np.sum(out != ref))
                err = ""
                if kind in "iu":
                    err = f", max abs err {np.abs(out.astype(np.float64) - ref).max():.3g}"
                return f"wrong result: {label} {bad} of {ref.size} elements differ{err}"
            continue
        tol = rtol
        if ref.dtype.name == "bfloat16":
            tol = max(rtol, 2 ** -6)  # two bfloat16 ULPs, as onnx's runner
        o, r = _as_float(out), _as_float(ref)
        close = np.isclose(o, r, rtol=tol, atol=atol, equal_nan=True)
        if not close.all():
            finite = np.isfinite(o) & np.isfinite(r)
            diff = np.abs(o - r)[finite & ~close]
            err = f"{diff.max():.3g}" if diff.size else "inf/nan"
            return (f"wrong result: {label} max abs err {err} ({int((~close).sum())} of "
                    f"{ref.size} elements off, rtol {tol:g} atol {atol:g})")
    return None


# -- reasons ---------------------------------------------------------------------------------
_NOISE = re.compile(r"^(Traceback|File |During handling|The above exception|at |\d+: |-+$|\^+$|~+$)")


def first_line(err: BaseException) -> str:
    """The first meaningful line of an exception's message (TVM's carry tracebacks)."""
    lines = [line.strip() for line in str(err).splitlines()]
    lines = [line for line in lines if line and not _NOISE.match(line)]
    for line in lines:
        if "Check failed" in line:
            return line[:240]
    return lines[0][:240] if lines else ""


def describe(err: BaseException) -> str:
    """``ExceptionType: first line``; a bare one (``assert x``) says where it was raised."""
    text = first_line(err)
    if not text:
        frames = traceback.extract_tb(err.__traceback__)
        if frames:
            last = frames[-1]
            where = "/".join(Path(last.filename).parts[-2:])
            text = f"at {where}:{last.lineno}" + (f": {last.line.strip()}" if last.line else "")
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# -- worker side -----------------------------------------------------------------------------
class _Stages:
    """Tells the parent which stage runs now: a crash or timeout is reported in it."""

    def __init__(self, conn):
        self.conn, self.now = conn, "start"

    def __call__(self, stage: str) -> None:
        self.now = stage
        self.conn.send(("stage", stage))


def _to_numpy(value: Any) -> Any:
    import tvm  # pylint: disable=import-outside-toplevel

    if isinstance(value, tvm.runtime.Tensor):
        return value.numpy()
    if isinstance(value, tvm.runtime.ShapeTuple):
        return np.array(list(value), np.int64)
    if isinstance(value, (str, bytes)):
        return np.asarray(value)
    if hasattr(value, "__len__") and hasattr(value, "__getitem__"):
        return [_to_numpy(v) for v in value]
    if value is None:
        return None
    return np.asarray(value)


def _tvm_arg(value: Any):
    import tvm  # pylint: disable=import-outside-toplevel

    if value is None:
        return None
    if isinstance(value, list):
        return [_tvm_arg(v) for v in value]
    return tvm.runtime.tensor(np.ascontiguousarray(value) if value.ndim else value, tvm.cpu())


def _failing_op(printed: str) -> str | None:
    found = re.findall(r"Error converting operator (\w+)", printed)
    return found[-1] if found else None


def _run_tvm(case: Case, stage: _Stages) -> list[Any]:
    import onnx  # pylint: disable=import-outside-toplevel
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm import relax  # pylint: disable=import-outside-toplevel
    from tvm.relax.frontend.onnx import from_onnx  # pylint: disable=import-outside-toplevel

    model = onnx.ModelProto.FromString(case.model)
    stage("import")
    mod = from_onnx(model)  # keep_params_in_input=False: initializers are constants
    stage("compile")
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    stage("load")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    stage("inputs")  # numpy to TVM tensors
    initializers = {i.name for i in model.graph.initializer}
    names = [v.name for v in model.graph.input]
    args = [_tvm_arg(a) for n, a in zip(names, case.inputs) if n not in initializers]
    stage("run")
    result = vm["main"](*args)
    stage("outputs")  # TVM tensors to numpy
    result = _to_numpy(result)
    if len(model.graph.output) == 1:
        return [result]
    return list(result) if isinstance(result, list) else [result]


def grape_dims(model, inputs: list[Any]) -> dict[str, tuple[int, int]]:
    """A range for each dim_param of the tensor inputs, around the case's actual size."""
    initializers = {i.name for i in model.graph.initializer}
    dims: dict[str, tuple[int, int]] = {}
    for value, array in zip(model.graph.input, inputs):
        if value.name in initializers or not value.type.HasField("tensor_type"):
            continue
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_param") and dim.dim_param:
                size = int(np.shape(array)[axis]) if isinstance(array, np.ndarray) and \
                    axis < np.ndim(array) else 1
                lo, hi = dims.get(dim.dim_param, (size, size))
                dims[dim.dim_param] = (1, max(hi, lo, size, 1) * 2)
    return dims


def _run_grape(case: Case, stage: _Stages, workdir: Path) -> list[Any]:
    import onnx  # pylint: disable=import-outside-toplevel

    import grape_tvm  # pylint: disable=import-outside-toplevel

    model = onnx.ModelProto.FromString(case.model)
    stage("compile")
    module = grape_tvm.compile_onnx(model, dims=grape_dims(model, case.inputs), target="llvm")
    stage("export")
    path = workdir / f"{case.name}.grape"
    module.export(path)
    stage("load")
    try:
        executor = grape_tvm.load(path, "cpu")
    finally:
        path.unlink(missing_ok=True)
    stage("run")
    initializers = {i.name for i in model.graph.initializer}
    inputs = {v.name: a for v, a in zip(model.graph.input, case.inputs)
              if v.name not in initializers}
    result = executor.run(inputs)
    names = [o.name for o in model.graph.output]
    if set(result) == set(names):
        return [result[n] for n in names]
    return list(result.values())


def _grape_stage(err: BaseException, stage: str) -> tuple[str, BaseException]:
    """grape's compile_onnx is one call: tell signature, import and lowering apart."""
    if stage != "compile":
        return stage, err
    from grape_tvm.frontend import ImportError_  # pylint: disable=import-outside-toplevel

    if isinstance(err, ImportError_) and err.__cause__ is not None:
        return "import", err.__cause__
    names = [f.name for f in traceback.extract_tb(err.__traceback__)]
    if "onnx_signature" in names:
        return "signature", err
    if "import_onnx" in names:
        return "import", err
    return stage, err


def run_path(case: Case, path: str, stage: _Stages, workdir: Path) -> dict:
    """Run one path of one case: ``{"ok": bool, "reason": str | None, "seconds": float}``."""
    start = time.perf_counter()
    printed = io.StringIO()
    matched = "expected"  # the suite's expected outputs, or onnxruntime's where they differ
    try:
        with contextlib.redirect_stdout(printed), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outputs = _run_tvm(case, stage) if path == "tvm" else _run_grape(case, stage, workdir)
        stage("compare")
        import onnx  # pylint: disable=import-outside-toplevel

        names = [o.name for o in onnx.ModelProto.FromString(case.model).graph.output]
        why = compare(outputs, case.outputs, case.rtol, case.atol, names)
        if why is not None and _half_precision(case.outputs):
            stage("onnxruntime")
            reference = onnxruntime_outputs(case)
            if reference is not None and \
                    compare(outputs, reference, case.rtol, case.atol, names) is None:
                matched = "onnxruntime"
                why = None
    except Exception as err:  # pylint: disable=broad-except
        where, cause = (stage.now, err) if path == "tvm" else _grape_stage(err, stage.now)
        inner = _failing_op(printed.getvalue())
        at = f" of {inner}" if inner and inner != case.op else ""
        why = f"{where}{at}: {describe(cause)}"
    seconds = time.perf_counter() - start
    reason = None if why is None else f"{case.op}: {why}"
    return {"ok": why is None, "reason": reason, "seconds": round(seconds, 3),
            "matched": matched if why is None else None}


def _half_precision(outputs: list[Any]) -> bool:
    """Some output is float16 or bfloat16: where the suite's stored values are numpy's
    roundings, an ulp from onnxruntime's (the only case the second reference is for)."""
    return any(isinstance(o, np.ndarray) and o.dtype.name in ("float16", "bfloat16")
               for o in outputs)


def onnxruntime_outputs(case: Case) -> list[Any] | None:
    """The case's outputs from onnxruntime on the CPU, the second reference: a result off
    the suite's expected output but equal to onnxruntime's (both within the case's
    tolerance) is not a wrong answer. None where onnxruntime is absent or cannot run it."""
    try:
        import onnxruntime  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    import onnx  # pylint: disable=import-outside-toplevel

    graph = onnx.ModelProto.FromString(case.model).graph
    initialized = {i.name for i in graph.initializer}
    names = [i.name for i in graph.input if i.name not in initialized]
    if any(isinstance(v, list) or v is None for v in case.inputs):
        return None
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    try:
        session = onnxruntime.InferenceSession(case.model, options,
                                               providers=["CPUExecutionProvider"])
        return session.run(None, dict(zip(names, case.inputs)))
    except Exception:  # pylint: disable=broad-except
        return None


FAULT_ENV = "GRAPE_TVM_CONFORMANCE_FAULT"  # tests: "CASE:PATH:segv|hang,..." in the workers


def _inject_fault(case: Case, path: str, stage: _Stages) -> None:
    for item in os.environ.get(FAULT_ENV, "").split(","):
        name, _, rest = item.partition(":")
        where, _, fault = rest.partition(":")
        if name == case.name and where == path:
            stage("run")
            if fault == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if fault == "hang":
                time.sleep(3600)


def _worker(conn, log_path: str, workdir: str) -> None:
    """A worker process: runs ``(index, path, case)`` tasks until it gets ``None``."""
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import tvm  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import tvm.relax.frontend.onnx  # noqa: F401  pylint: disable=import-outside-toplevel

    import grape_tvm.onnx_compiler  # noqa: F401  pylint: disable=import-outside-toplevel
    import grape_tvm.loader  # noqa: F401  pylint: disable=import-outside-toplevel

    conn.send(("ready",))
    while True:
        task = conn.recv()
        if task is None:
            break
        index, path, case = task
        sys.stdout.flush()
        sys.stderr.flush()
        os.ftruncate(fd, 0)
        stage = _Stages(conn)
        _inject_fault(case, path, stage)
        result = run_path(case, path, stage, Path(workdir))
        conn.send(("done", index, path, result))
    conn.close()


# -- parent side -----------------------------------------------------------------------------
def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _log_tail(log_path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _log_hint(log_path: Path) -> str:
    """The last telling line a crashed worker wrote (a TVM check, a fatal error)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-200:]
    except OSError:
        return ""
    for line in reversed(lines):
        text = line.strip()
        if re.search(r"Check failed|Error|error:|Assert|abort", text) and \
                not text.startswith(("File ", "Current thread", "Thread ", "Fatal Python")):
            return text[:200]
    return ""


class _Slot:
    """One worker process and the task it runs."""

    def __init__(self, ctx, index: int, workdir: Path):
        self.log = workdir / f"worker{index}.log"
        self.workdir = workdir
        self.ctx = ctx
        self.proc = None
        self.conn = None
        self.task: tuple[int, str] | None = None
        self.stage = "start"
        self.started = 0.0
        self.tasks = 0
        self.ready = False

    def start(self) -> None:
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, str(self.log), str(self.workdir)),
                                     daemon=True)
        self.proc.start()
        child.close()
        self.conn, self.tasks, self.ready, self.task = parent, 0, False, None
        self.started = time.perf_counter()

    def send(self, index: int, path: str, case: Case) -> None:
        self.task, self.stage, self.started = (index, path), "start", time.perf_counter()
        self.conn.send((index, path, case))
        self.tasks += 1

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(5)
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(None)
            self.proc.join(10)
        self.kill()


@dataclass
class Progress:
    total: int
    stream: Any = field(default_factory=lambda: sys.stderr)
    done: int = 0
    passed: dict = field(default_factory=lambda: {p: 0 for p in PATHS})
    start: float = field(default_factory=time.perf_counter)
    _last: float = 0.0

    def show(self, final: bool = False) -> None:
        now = time.perf_counter()
        tty = self.stream.isatty()
        if not final and now - self._last < (0.5 if tty else 15.0):
            return
        self._last = now
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        line = (f"conformance: {self.done}/{self.total} cases, tvm pass {self.passed['tvm']}, "
                f"grape pass {self.passed['grape']}, {rate:.2f} cases/s, "
                f"{elapsed:.0f} s elapsed, ETA {eta:.0f} s")
        self.stream.write(("\r" + line + " " * 4) if tty else line + "\n")
        if final and tty:
            self.stream.write("\n")
        self.stream.flush()


def run_cases(cases: list[Case], jobs: int = 2, timeout: float = 60.0,
              progress: bool = True) -> dict[str, dict[str, dict]]:
    """``{case name: {path: {"ok", "reason", "seconds"}}}`` for every case and path."""
    ctx = multiprocessing.get_context("spawn")
    tasks = collections.deque((i, p) for i in range(len(cases)) for p in PATHS)
    results: dict[str, dict[str, dict]] = {c.name: {} for c in cases}
    bar = Progress(len(cases))
    workdir = Path(tempfile.mkdtemp(prefix="grape-conformance-"))
    saved_cache = os.environ.get("GRAPE_TVM_CACHE")
    os.environ["GRAPE_TVM_CACHE"] = str(workdir / "cache")  # the workers' .so files, removed after
    slots = [_Slot(ctx, k, workdir) for k in range(max(1, min(jobs, len(tasks) or 1)))]

    def finish(index: int, path: str, outcome: dict) -> None:
        case = cases[index]
        results[case.name][path] = outcome
        if outcome["ok"]:
            bar.passed[path] += 1
        if len(results[case.name]) == len(PATHS):
            bar.done += 1
            if progress:
                bar.show()

    try:
        for slot in slots:
            slot.start()
        while tasks or any(s.task is not None for s in slots):
            for slot in slots:  # hand out work
                if slot.task is None and slot.ready and tasks:
                    if slot.tasks >= RECYCLE_AFTER:
                        slot.stop()
                        slot.start()
                        continue
                    index, path = tasks.popleft()
                    slot.send(index, path, cases[index])
            waitables = [s.conn for s in slots if s.conn is not None] + \
                        [s.proc.sentinel for s in slots if s.proc is not None]
            ready = wait(waitables, timeout=1.0)
            for slot in slots:
                if slot.conn in ready:
                    try:
                        while slot.conn.poll():
                            msg = slot.conn.recv()
                            if msg[0] == "ready":
                                slot.ready = True
                            elif msg[0] == "stage":
                                slot.stage = msg[1]
                            elif msg[0] == "done":
                                _, index, path, outcome = msg
                                slot.task = None
                                finish(index, path, outcome)
                    except (EOFError, OSError):
                        pass  # died: the sentinel says how
                dead = slot.proc is not None and not slot.proc.is_alive()
                late = slot.task is not None and time.perf_counter() - slot.started > timeout
                if not dead and not late:
                    if slot.task is None and not slot.ready and \
                            time.perf_counter() - slot.started > max(timeout, 120):
                        raise RuntimeError("a conformance worker did not start:\n"
                                           + _log_tail(slot.log))
                    continue
                if slot.task is not None:
                    index, path = slot.task
                    if late and not dead:
                        why = f"timeout: over {timeout:g} s in {slot.stage}"
                    else:
                        code = slot.proc.exitcode
                        how = (f"signal {-code} ({_signal_name(-code)})" if code and code < 0
                               else f"exit code {code}")
                        hint = _log_hint(slot.log)
                        why = f"crashed: {how} in {slot.stage}" + (f": {hint}" if hint else "")
                    slot.kill()
                    finish(index, path, {"ok": False, "reason": f"{cases[index].op}: {why}",
                                         "seconds": round(time.perf_counter() - slot.started, 3)})
                elif dead and not slot.ready:
                    raise RuntimeError(f"a conformance worker died at start (exit code "
                                       f"{slot.proc.exitcode}):\n" + _log_tail(slot.log))
                slot.kill()
                slot.start()
    finally:
        for slot in slots:
            slot.stop()
        if saved_cache is None:
            os.environ.pop("GRAPE_TVM_CACHE", None)
        else:
            os.environ["GRAPE_TVM_CACHE"] = saved_cache
        shutil.rmtree(workdir, ignore_errors=True)
    if progress:
        bar.show(final=True)
    return results


# -- summary ---------------------------------------------------------------------------------
_CATEGORY_RULES = [
    (re.compile(r"^wrong result: .*?(shape|dtype) "), lambda m: f"wrong result: {m.group(1)}"),
    (re.compile(r"^wrong result: .*(elements differ)"), lambda m: "wrong result: exact values differ"),
    (re.compile(r"^wrong result"), lambda m: "wrong result: beyond tolerance"),
    (re.compile(r"^(crashed: (signal \d+ \(\w+\)|exit code -?\d+) in \w+)"), lambda m: m.group(1)),
    (re.compile(r"^(timeout): .* in (\w+)"), lambda m: f"timeout in {m.group(2)}"),
    (re.compile(r"OpNotImplemented: The following operators are not supported"),
     lambda m: "import: OpNotImplemented: operator not supported by TVM's ONNX frontend"),
]


def category(reason: str) -> str:
    """A reason without its operator, with names and numbers taken out: the failure's kind."""
    text = reason.split(": ", 1)[1] if ": " in reason else reason
    for pattern, name in _CATEGORY_RULES:
        found = pattern.search(text)
        if found:
            return name(found)
    text = re.sub(r"^(\w+) of \w+:", r"\1:", text)  # "import of ReduceMax:" -> "import:"
    if re.match(r"^\w+: KeyError: '[^']*'$", text):
        return text  # the missing key (an attribute, an input) is the kind of failure
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    while True:  # innermost brackets first: "(shape (1,))" -> "(…)"
        shorter = re.sub(r"\[[^\[\]()]*\]|\([^\[\]()]*\)", "\x00", text)
        if shorter == text:
            break
        text = shorter
    text = text.replace("\x00", "(…)")
    text = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text[:110]


def _is_wrong_result(reason: str) -> bool:
    """The case compiled and ran, and its outputs differ from the expected ones."""
    return category(reason).startswith("wrong result")


def summarize(cases: list[Case], results: dict, command: str, wall_s: float,
              settings: dict | None = None) -> dict:
    names = [c.name for c in cases]
    ok = {p: {n for n in names if results[n].get(p, {}).get("ok")} for p in PATHS}
    fails = {p: {n: results[n][p]["reason"] for n in names if n not in ok[p]} for p in PATHS}
    versions = {}
    with contextlib.suppress(Exception):
        import onnx  # pylint: disable=import-outside-toplevel

        versions["onnx"] = onnx.__version__
    with contextlib.suppress(Exception):
        from importlib.metadata import version  # pylint: disable=import-outside-toplevel

        versions["tvm"] = version("apache-tvm")
    import grape_tvm  # pylint: disable=import-outside-toplevel

    versions["grape_tvm"] = grape_tvm.__version__
    return {
        "cases": len(cases),
        "tvm_pass": len(ok["tvm"]),
        "grape_pass": len(ok["grape"]),
        "grape_fail_where_tvm_passes": sorted(ok["tvm"] - ok["grape"]),
        "grape_pass_where_tvm_fails": sorted(ok["grape"] - ok["tvm"]),
        "failures": fails["grape"],
        "tvm_failures": fails["tvm"],
        # a compiler may refuse a model, never answer wrongly: this list should stay empty
        "wrong_results": sorted(n for n, why in fails["grape"].items() if _is_wrong_result(why)),
        # passes off the expected outputs but equal to onnxruntime's (``onnxruntime_outputs``)
        "grape_matches_onnxruntime_only": sorted(
            n for n in ok["grape"] if results[n]["grape"].get("matched") == "onnxruntime"),
        "tvm_matches_onnxruntime_only": sorted(
            n for n in ok["tvm"] if results[n]["tvm"].get("matched") == "onnxruntime"),
        "categories": dict(collections.Counter(category(r) for r in fails["grape"].values())
                           .most_common()),
        "tvm_categories": dict(collections.Counter(category(r) for r in fails["tvm"].values())
                               .most_common()),
        "command": command,
        "wall_s": round(wall_s, 1),
        "versions": versions,
        "settings": settings or {},
        "seconds": {n: {p: results[n][p]["seconds"] for p in PATHS if p in results[n]}
                    for n in names},
    }


def table(report: dict, top: int = 10) -> str:
    n = max(report["cases"], 1)
    rows = [
        f"ONNX node conformance on CPU (llvm): {report['cases']} cases in {report['wall_s']:.0f} s",
        f"  {'cases':<34}{report['cases']:>6}",
        f"  {'TVM pass (relax from_onnx + VM)':<34}{report['tvm_pass']:>6}  "
        f"({100 * report['tvm_pass'] / n:.1f}%)",
        f"  {'grape pass (compile_onnx + load)':<34}{report['grape_pass']:>6}  "
        f"({100 * report['grape_pass'] / n:.1f}%)",
        f"  {'grape fails where TVM passes':<34}{len(report['grape_fail_where_tvm_passes']):>6}",
        f"  {'grape passes where TVM fails':<34}{len(report['grape_pass_where_tvm_fails']):>6}",
        f"  {'grape wrong results':<34}{len(report['wrong_results']):>6}",
        f"top grape failure categories ({len(report['failures'])} failures):",
    ]
    for name, count in list(report["categories"].items())[:top]:
        rows.append(f"  {count:>5}  {name}")
    if report["grape_fail_where_tvm_passes"]:
        rows.append("grape fails where TVM passes:")
        for case in report["grape_fail_where_tvm_passes"][:top]:
            rows.append(f"  {case}: {report['failures'][case]}")
        more = len(report["grape_fail_where_tvm_passes"]) - top
        if more > 0:
            rows.append(f"  ... and {more} more (see the JSON)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m grape_tvm.conformance",
        description="Run onnx's node test cases through TVM's Relax path and grape's, on CPU.")
    parser.add_argument("--json", required=True, type=Path, help="write the report here")
    parser.add_argument("--limit", type=int, default=None, help="the first N cases (by name)")
    parser.add_argument("--filter", action="append", default=[], metavar="SUBSTR",
                        help="cases whose name contains SUBSTR or whose operator is SUBSTR "
                             "(case-insensitive); repeat or separate with commas")
    parser.add_argument("--case", action="append", default=[], metavar="NAME",
                        help="the case of this exact name (test_add); repeat or separate with "
                             "commas; adds to --filter's cases")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds per case and path before it counts as a timeout")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args(argv)
    filters = [f.strip() for item in args.filter for f in item.split(",") if f.strip()]
    names = [n.strip() for item in args.case for n in item.split(",") if n.strip()]

    start = time.perf_counter()
    try:
        cases = collect_cases(filters, args.limit, names)
    except ValueError as err:
        print(f"conformance: {err}", file=sys.stderr)
        return 2
    if not cases:
        print("no case matches", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"conformance: {len(cases)} cases, {args.jobs} worker(s), {args.timeout:g} s "
              "timeout per case and path", file=sys.stderr, flush=True)
    results = run_cases(cases, args.jobs, args.timeout, progress=not args.quiet)
    command = shlex.join(["python", "-m", "grape_tvm.conformance", *argv])
    settings = {"limit": args.limit, "filters": filters, "cases": names, "jobs": args.jobs,
                "timeout_s": args.timeout, "target": {"kind": "llvm"}, "device": "cpu",
                "tolerance": "each case's rtol/atol (onnx's node cases: rtol 1e-3, atol 1e-7); "
                             "bool, integer and string outputs exact"}
    report = summarize(cases, results, command, time.perf_counter() - start, settings)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
