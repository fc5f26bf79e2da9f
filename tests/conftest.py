"""Shared ONNX models for the CPU tests: small, seeded, with symbolic dimensions."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from blocks import make_blocks  # noqa: E402  pylint: disable=wrong-import-position


def make_if_model() -> onnx.ModelProto:
    """``y = x * 2 + 1`` when ``sum(x) > 0`` else ``relu(x) - 3``: a data-dependent branch."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    three = numpy_helper.from_array(np.array(3.0, np.float32), "three")
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    out_info = helper.make_tensor_value_info
    then_graph = helper.make_graph(
        [helper.make_node("Mul", ["h", "two"], ["t0"]), helper.make_node("Add", ["t0", "one"], ["t"])],
        "then", [], [out_info("t", TensorProto.FLOAT, ["n", 8])])
    else_graph = helper.make_graph(
        [helper.make_node("Relu", ["h"], ["e0"]), helper.make_node("Sub", ["e0", "three"], ["e"])],
        "else", [], [out_info("e", TensorProto.FLOAT, ["n", 8])])
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("ReduceSum", ["h"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["y0"], then_branch=then_graph, else_branch=else_graph),
        helper.make_node("Tanh", ["y0"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "if_model", [out_info("x", TensorProto.FLOAT, ["n", 8])],
                              [out_info("y", TensorProto.FLOAT, ["n", 8])], [w, two, one, three, zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def make_two_input_model() -> onnx.ModelProto:
    """``y = x * mask[..., None]`` with x: (b, n, 8) and mask: (b, n): two inputs share dims."""
    nodes = [
        helper.make_node("Unsqueeze", ["mask", "axes"], ["m3"]),
        helper.make_node("Mul", ["x", "m3"], ["y"]),
    ]
    axes = numpy_helper.from_array(np.array([2], np.int64), "axes")
    info = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "masked",
        [info("x", TensorProto.FLOAT, ["b", "n", 8]), info("mask", TensorProto.FLOAT, ["b", "n"])],
        [info("y", TensorProto.FLOAT, ["b", "n", 8])], [axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "blocks": _save(make_blocks(width=64, blocks=2), root / "blocks.onnx"),
        "if": _save(make_if_model(), root / "if_model.onnx"),
        "two_inputs": _save(make_two_input_model(), root / "two_inputs.onnx"),
    }


def onnxruntime_outputs(path: Path, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


def affine_loop_inputs(n: int, trip: int, cond: bool = True) -> dict:
    """Inputs of tests/test_onnx_loop.py's affine loop (its GPU test too: no compiler here)."""
    rng = np.random.default_rng(n)
    return {"M": np.array(trip, np.int64), "cond": np.array(cond),
            "x": rng.random(n).astype(np.float32), "b": rng.random(n).astype(np.float32)}


def affine_loop_steps(x, b, trip, a=1.25, thr=500.0) -> int:
    """The steps ONNX's semantics take (float32, as onnxruntime computes them)."""
    steps = 0
    while steps < trip:
        x = x * np.float32(a) + b
        steps += 1
        if not x.sum(dtype=np.float32) <= thr:
            break
    return steps


# -- disco's collectives on the CPU: numpy stand-ins (this TVM wheel has no CPU collectives:
# ``init_ccl`` takes NCCL or RCCL only), for tests/test_tensor_parallel*.py --------------

COLLECTIVES = ("allreduce", "allgather", "broadcast_from_worker0", "scatter_from_worker0",
               "gather_to_worker0", "worker_id")
# disco's reduction codes (TVM's legalization of R.ccl.allreduce) and what each computes
REDUCTIONS = {0: np.sum, 1: np.prod, 2: np.min, 3: np.max, 4: np.mean}


class _Collectives:
    """disco's collectives for ranks that are threads of this process: each call trades its
    tensor with the other ranks' at a barrier (the rank is thread-local)."""

    def __init__(self, world: int):
        self.world = world
        self.local = threading.local()
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list = [None] * world

    def _everyone(self, value: np.ndarray) -> list[np.ndarray]:
        self.slots[self.local.rank] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # all have read before anyone writes the next
        return got

    def allreduce(self, x, op, _in_group, out):
        parts = self._everyone(x.numpy())
        out.copyfrom(REDUCTIONS[int(op[0])](parts, axis=0).astype(parts[0].dtype))

    def allgather(self, x, _in_group, out):
        out.copyfrom(np.concatenate(self._everyone(x.numpy()), axis=0))

    def broadcast_from_worker0(self, x, _in_group, out):
        out.copyfrom(self._everyone(x.numpy())[0])

    def scatter_from_worker0(self, x, _in_group, out):
        # disco's layout: rank r's part is the r-th of ``world`` contiguous chunks
        chunks = self._everyone(x.numpy())[0].reshape(self.world, -1)
        out.copyfrom(chunks[self.local.rank].reshape(tuple(out.shape)))

    def gather_to_worker0(self, x, _in_group, out):
        parts = self._everyone(x.numpy())
        if self.local.rank == 0:  # only worker 0 holds ``out``
            out.copyfrom(np.stack(parts))

    def worker_id(self):
        return tvm.runtime.ShapeTuple([self.local.rank])


def _installing(make, names):
    """A fixture's body: ``install(world)`` registers ``make(world)``'s ``names`` as
    ``runtime.disco.*``; the functions before come back after."""
    before = {name: tvm.get_global_func(f"runtime.disco.{name}", allow_missing=True)
              for name in names}

    def install(world: int):
        standin = make(world)
        for name in names:
            tvm.register_global_func(f"runtime.disco.{name}", getattr(standin, name), override=True)
        return standin

    yield install
    for name, func in before.items():
        if func is not None:
            tvm.register_global_func(f"runtime.disco.{name}", func, override=True)


@pytest.fixture
def collectives():
    """``_Collectives`` as disco's collectives and ``worker_id``."""
    yield from _installing(_Collectives, COLLECTIVES)


class _DiscoCollectives(_Collectives):
    """``_Collectives`` for the workers of a disco threaded session: the rank is disco's own
    ``worker_id``; a worker that holds no source (not worker 0) gives None."""

    def __init__(self, world: int):
        super().__init__(world)
        self._worker_id = tvm.get_global_func("runtime.disco.worker_id")

    def _everyone(self, value):
        self.local.rank = int(self._worker_id()[0])
        return super()._everyone(value)

    def broadcast_from_worker0(self, x, _in_group, out):
        out.copyfrom(self._everyone(None if x is None else x.numpy())[0])

    def scatter_from_worker0(self, x, _in_group, out):
        chunks = self._everyone(None if x is None else x.numpy())[0].reshape(self.world, -1)
        out.copyfrom(chunks[self.local.rank].reshape(tuple(out.shape)))


@pytest.fixture
def disco_collectives():
    """``_DiscoCollectives`` as disco's collectives (its own ``worker_id`` kept)."""
    yield from _installing(_DiscoCollectives, [n for n in COLLECTIVES if n != "worker_id"])
