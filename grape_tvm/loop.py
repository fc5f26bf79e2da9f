"""Loops over a step function: ``compile_loop`` (``grape_tvm.compiler``) compiles one,
``load_loop`` here loads it where it is deployed (the TVM runtime is enough).

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

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grape_tvm.loader import load, load_library
from grape_tvm.runtime.device_loop import DeviceLoop, HostLoop, LoopResult, LoopSpec
from grape_tvm.runtime.onnx_loop import OnnxLoop, is_onnx_loop

MODES = ("auto", "device", "host")


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
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    executor = load(path, device, **kwargs)
    try:
        return GrapeLoop(executor, loop_runner(executor, path, mode))
    except BaseException:
        executor.close()
        raise


def step_has_branches(manifest: dict) -> bool:
    """Whether a loop's step has data-dependent branches (conditional regions): a device
    loop cannot capture them yet, so such a loop runs a host loop on the GPU too."""
    return bool(manifest["plan"].get("conditionals"))


def loop_runner(executor, path: str | Path, mode: str = "auto") -> HostLoop | DeviceLoop:
    """The runner of the loop ``executor`` (loaded from ``path``) runs, by ``mode`` (see
    ``load_loop``): also what each rank of a tensor-parallel loop runs, around the executor
    its worker loaded. The caller keeps owning ``executor``, and closes the runner (its
    graphs, its state buffers)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    spec_json = executor.manifest.get("loop")
    if spec_json is None:
        raise ValueError(f"{path} was not compiled by compile_loop: it has no loop")
    spec = LoopSpec.from_json(spec_json)
    branched = step_has_branches(executor.manifest)
    if branched and mode == "device":
        raise ValueError(f"{path}: the step has data-dependent branches (conditional regions), "
                         "which a device loop cannot capture yet; use mode='host' (each step "
                         "one call, its branches guarded on the device)")
    on_gpu = getattr(executor.backend, "name", "") == "cuda-graph"
    if mode == "device" and not on_gpu:
        raise ValueError("mode='device' needs a CUDA artifact loaded on a GPU")
    if on_gpu and mode != "host" and not branched:
        library, _, _ = load_library(path, executor.device)
        return DeviceLoop(executor, spec, library)
    return HostLoop(executor, spec)


def load_onnx_loop(path: str | Path, device: Any = "cpu", *, max_steps: int | None = None,
                   **kwargs) -> OnnxLoop:
    """Load an artifact compiled from an ONNX Loop (``compile_onnx``); ``kwargs`` go to
    ``load_loop`` (``mode="host"`` runs it one executor call per step on a GPU too)."""
    loop = load_loop(path, device, **kwargs)
    if not is_onnx_loop(loop.executor.manifest):
        loop.close()
        raise ValueError(f"{path} was not compiled from an ONNX Loop")
    return OnnxLoop(loop, max_steps)
