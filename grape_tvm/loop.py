"""Loops over a step function: ``compile_loop`` here, ``load_loop`` where it is deployed.

    step = ...  # IRModule: main(state..., invariants...) -> (next state..., stop)
    m = grape_tvm.compile_loop(step, carried=["token", "pos", "k0", ...], max_steps=256,
                               dims={"batch": (1, 8)}, target="cuda")
    m.export("decode.grape")

    loop = grape_tvm.load_loop("decode.grape", "cuda")   # one graph launch per loop
    loop.bind_inputs(weights)
    result = loop.run(initial_state)                      # result.state, result.steps

The step's carried state must keep its shapes from step to step (a KV cache of fixed
capacity with a position, as in PyTorch's static cache): one graph then serves every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tvm_ffi.structural import structural_equal

from grape_tvm.runtime.device_loop import STOP_DTYPES, DeviceLoop, HostLoop, LoopResult, LoopSpec
from grape_tvm.runtime.onnx_loop import OnnxLoop, is_onnx_loop

MODES = ("auto", "device", "host")


def _check_step(main, carried: Sequence[str], stop: str) -> None:
    from tvm import relax  # pylint: disable=import-outside-toplevel

    params = {p.name: p for p in main.params}
    unknown = [n for n in carried if n not in params]
    if unknown:
        raise ValueError(f"carried state {unknown} are not inputs of the step; it takes "
                         f"{list(params)}")
    if len(set(carried)) != len(carried) or stop in carried:
        raise ValueError(f"carried names must be distinct and differ from stop {stop!r}")
    rets = list(main.ret_ty.fields) if isinstance(main.ret_ty, relax.TupleType) else [main.ret_ty]
    if len(rets) != len(carried) + 1:
        raise ValueError(f"the step must return the next value of each carried input "
                         f"({len(carried)}) and then the stop flag: it returns {len(rets)} values")
    for name, ret in zip(carried, rets):
        want = params[name].ty
        if not structural_equal(want, ret):
            raise ValueError(f"the step's next {name!r} is {ret}, but {name!r} is {want}: "
                             "loop state keeps its shape and dtype")
    if str(rets[-1].dtype) not in STOP_DTYPES:
        raise ValueError(f"stop {stop!r} has dtype {rets[-1].dtype}; expected one of "
                         f"{STOP_DTYPES} (the loop stops when any element is non-zero)")


def compile_loop(step: Any, carried: Sequence[str], *, max_steps: int, stop: str = "stop",
                 dims: Mapping[str, Any] | None = None, target: Any = "llvm", **kwargs):
    """Compile a step function for ``load_loop``: a ``GrapeModule`` whose manifest says
    which inputs are the loop state (``carried``, in the order of the step's outputs), the
    name of the stop output (the step's last output) and the default step limit."""
    from grape_tvm.compiler import build  # pylint: disable=import-outside-toplevel

    if int(max_steps) < 1:
        raise ValueError(f"max_steps must be at least 1, got {max_steps}")
    _check_step(step["main"], carried, stop)
    module = build(step, dims, target, output_names=[*carried, stop], **kwargs)
    module.loop = LoopSpec(tuple(carried), stop, int(max_steps)).to_json()
    return module


class GrapeLoop:
    """A loaded loop: its executor (for ``bind_inputs`` and single steps) and its runner."""

    def __init__(self, executor, runner: HostLoop | DeviceLoop):
        self.executor = executor
        self.runner = runner
        self.spec = runner.spec

    @property
    def mode(self) -> str:
        return "device" if isinstance(self.runner, DeviceLoop) else "host"

    def bind_inputs(self, inputs: Mapping[str, Any]) -> None:
        """Bind the loop invariants (weights): see ``GraphExecutor.bind_inputs``."""
        self.executor.bind_inputs(inputs)

    def run(self, state: Mapping[str, Any], max_steps: int | None = None) -> LoopResult:
        """Run steps from ``state`` until stop or ``max_steps`` (the compiled default)."""
        return self.runner.run(state, max_steps)

    def close(self) -> None:
        if isinstance(self.runner, DeviceLoop):
            self.runner.close()
        self.executor.close()

    def __enter__(self) -> "GrapeLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_loop(path: str | Path, device: Any = "cpu", *, mode: str = "auto",
              **kwargs) -> GrapeLoop:
    """Load a ``compile_loop`` artifact. ``mode="device"`` (the default on CUDA) runs the
    whole loop as one graph launch; ``"host"`` (the CPU's) one executor call per step.
    A step with data-dependent branches runs as a host loop (``"auto"``) for now."""
    from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    executor = load(path, device, **kwargs)
    spec_json = executor.manifest.get("loop")
    if spec_json is None:
        executor.close()
        raise ValueError(f"{path} was not compiled by compile_loop: it has no loop")
    spec = LoopSpec.from_json(spec_json)
    branched = bool(executor.manifest["plan"].get("conditionals"))
    if branched and mode == "device":
        executor.close()
        raise ValueError(f"{path}: the step has data-dependent branches (conditional regions), "
                         "which a device loop cannot capture yet; use mode='host' (each step "
                         "one call, its branches guarded on the device)")
    on_gpu = getattr(executor.backend, "name", "") == "cuda-graph"
    if mode == "device" and not on_gpu:
        executor.close()
        raise ValueError("mode='device' needs a CUDA artifact loaded on a GPU")
    if on_gpu and mode != "host" and not branched:
        library, _, _ = load_library(path, device)
        return GrapeLoop(executor, DeviceLoop(executor, spec, library))
    return GrapeLoop(executor, HostLoop(executor, spec))


def load_onnx_loop(path: str | Path, device: Any = "cpu", *, max_steps: int | None = None,
                   **kwargs) -> OnnxLoop:
    """Load an artifact compiled from an ONNX Loop (``compile_onnx``); ``kwargs`` go to
    ``load_loop`` (``mode="host"`` runs it one executor call per step on a GPU too)."""
    loop = load_loop(path, device, **kwargs)
    if not is_onnx_loop(loop.executor.manifest):
        loop.close()
        raise ValueError(f"{path} was not compiled from an ONNX Loop")
    return OnnxLoop(loop, max_steps)
