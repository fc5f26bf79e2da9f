"""Running an artifact compiled from an ONNX ``Loop``: the graph's inputs in, its outputs out.

``grape_tvm.onnx_loop`` turns the Loop into a ``compile_loop`` step and writes how to run it
into the manifest (``loop["onnx"]``): where the trip count ``M``, the initial ``cond`` and each
carried value come from, and where each graph output is read. ``OnnxLoop`` reads that back
and drives a loaded loop (``grape_tvm.load_onnx_loop``). The names of the step's extra state
and the encoding of constants are the contract between the two sides, defined here.

Needs the TVM runtime only, not onnx or TVM's compiler (a deployment host has neither).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import tvm

from .signature import Signature

ITER, COND, STOP = "grape_loop_iter", "grape_loop_cond", "grape_stop"
_CHUNK = 2**31 - 1  # the most steps one device launch counts (a u32 counter)


def npy_text(array: np.ndarray) -> str:
    """A constant as manifest text: its .npy bytes in base64."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def from_npy_text(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def is_onnx_loop(manifest: Mapping[str, Any]) -> bool:
    return "onnx" in (manifest.get("loop") or {})


class OnnxLoop:
    """A loaded ONNX Loop: ``run(inputs)`` takes the ONNX graph's inputs and returns its
    outputs (numpy arrays, by name); ``steps`` is how many steps the last run took."""

    def __init__(self, loop, max_steps: int | None = None):
        self.loop = loop  # a GrapeLoop
        # Invariants live in buffers of ours, one per (input, shape, dtype), refilled in place
        # at each run: a loop graph reads them where they were when it was captured, and
        # binding other tensors (only when a shape changes) makes the DeviceLoop rebuild it.
        self._buffers: dict[tuple, Any] = {}
        self._bound: dict[str, Any] = {}
        self.info = loop.executor.manifest["loop"]["onnx"]
        self.signature = Signature.from_json(self.info["signature"])
        self.max_steps = int(max_steps or loop.spec.max_steps)
        self.steps = 0
        self.launches = 0

    @property
    def mode(self) -> str:
        return self.loop.mode

    def _value(self, source: dict, inputs: Mapping[str, Any]) -> np.ndarray:
        if "input" in source:
            return np.asarray(inputs[source["input"]])
        return from_npy_text(source["const"])

    def _check(self, inputs: Mapping[str, Any]) -> None:
        """Names, dtypes, ranks and dims against the ONNX graph's signature (``bind`` names
        missing and unknown inputs too)."""
        arrays = {n: np.asarray(v) for n, v in inputs.items()}
        self.signature.bind({n: a.shape for n, a in arrays.items()},
                            {n: str(a.dtype) for n, a in arrays.items()})

    def run(self, inputs: Mapping[str, Any], max_steps: int | None = None) -> dict[str, np.ndarray]:
        """Run the Loop on the graph's inputs; ``max_steps`` overrides the step limit of a
        Loop without trip count (the compiled ``max_steps``)."""
        self._check(inputs)
        info = self.info
        trip = None if info["trip_count"] is None else \
            int(self._value(info["trip_count"], inputs).reshape(-1)[0])
        cond = True if info["cond"] is None else \
            bool(self._value(info["cond"], inputs).reshape(-1)[0])
        state: dict[str, Any] = {ITER: np.array(0, np.int64), COND: np.array(True)}
        state.update({c["state"]: self._value(c["init"], inputs) for c in info["carried"]})
        self.steps = self.launches = 0
        if (trip is None or trip > 0) and cond:
            state = self._loop(state, inputs, trip, max_steps)
        return self._outputs(state, inputs)

    def _loop(self, state: dict, inputs: Mapping[str, Any], trip: int | None,
              max_steps: int | None) -> dict:
        self._bind(inputs)
        limit = int(max_steps or self.max_steps) if trip is None else trip
        running = True
        while running and self.steps < limit:
            result = self.loop.run(state, max_steps=min(limit - self.steps, _CHUNK))
            self.steps += result.steps
            self.launches += 1
            state = result.state
            running = bool(state[COND].numpy())
        if trip is None and running:
            raise RuntimeError(
                f"Loop node {self.info['node']!r} has no trip count M and its condition is "
                f"still true after the step limit of {limit} steps: give a larger max_steps "
                "(to run or compile_onnx)")
        return state

    def _bind(self, inputs: Mapping[str, Any]) -> None:
        """The run's invariants copied into our buffers; those not bound yet bound."""
        rebind = {}
        for step_name, outer in self.info["invariants"].items():
            array = np.asarray(inputs[outer], order="C")  # keeps a 0-d input 0-d
            entry = (step_name, array.shape, str(array.dtype))
            buffer = self._buffers.get(entry)
            if buffer is None:
                buffer = self._buffers[entry] = tvm.runtime.tensor(array, self.loop.executor.device)
            else:
                buffer.copyfrom(array)
            if self._bound.get(step_name) is not buffer:
                rebind[step_name] = buffer
        if rebind:
            self.loop.bind_inputs(rebind)
            self._bound.update(rebind)

    def _outputs(self, state: dict, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        outputs = {}
        for entry in self.info["outputs"]:
            src = entry["source"]
            if "loop_output" in src:
                value = state[self.info["carried"][src["loop_output"]]["state"]]
                value = value.numpy() if hasattr(value, "numpy") else np.array(value)
            else:
                value = np.array(self._value(src, inputs))
            outputs[entry["name"]] = value
        return outputs

    def close(self) -> None:
        self.loop.close()

    def __enter__(self) -> "OnnxLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
