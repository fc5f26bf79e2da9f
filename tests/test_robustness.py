"""Robustness on the CPU: concurrent calls, a failing call, fuzzing against TVM's VM,
NaN/Inf, zero-size dims."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm.runtime.vm import VirtualMachine

import grape_tvm
from conftest import onnxruntime_outputs
from grape_tvm.compiler import PlannedMemoryError
from grape_tvm.loader import load, load_library


@pytest.fixture(scope="module")
def blocks(models, tmp_path_factory):
    path = tmp_path_factory.mktemp("robust") / "blocks.grape"
    grape_tvm.compile_onnx(models["blocks"], dims={"n": (1, 48)}, target="llvm").export(path)
    library, _, dev = load_library(path, "cpu")
    return path, VirtualMachine(library, dev), dev


def _vm(vm, dev, x):
    return vm["main"](tvm.runtime.tensor(x, dev)).numpy()


def test_fuzz_random_shapes_against_tvm_vm(blocks):
    path, vm, dev = blocks
    executor = load(path, "cpu")
    rng = np.random.default_rng(11)
    mismatches = 0
    for n in rng.integers(1, 49, size=300):
        x = rng.standard_normal((int(n), 64)).astype(np.float32)
        mismatches += not np.array_equal(executor.run({"x": x})["y"], _vm(vm, dev, x))
    assert mismatches == 0
    assert executor.stats.planned_calls > 200  # most calls ran without the VM


def test_two_threads_on_one_executor(blocks):
    """Calls are serialized by the executor's lock: each thread gets its own results."""
    path, vm, dev = blocks
    executor = load(path, "cpu")
    rng = np.random.default_rng(12)
    work = [[rng.standard_normal((int(n), 64)).astype(np.float32) for n in rng.integers(1, 49, 40)]
            for _ in range(2)]
    results: dict[int, list] = {0: [], 1: []}

    def worker(k):
        for x in work[k]:
            results[k].append(executor.run({"x": x})["y"])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(2):
        for x, y in zip(work[k], results[k]):
            np.testing.assert_array_equal(y, _vm(vm, dev, x))
    assert executor.stats.calls == 80


def test_a_call_that_fails_while_recording_leaves_the_executor_usable(blocks):
    path, vm, dev = blocks
    executor = load(path, "cpu")
    real_end = executor.backend.end

    def failing_end(recorder, run=True):
        executor.backend.end = real_end
        raise RuntimeError("injected failure while recording")

    executor.backend.end = failing_end
    x = np.ones((9, 64), np.float32)
    with pytest.raises(RuntimeError, match="injected failure"):
        executor.run({"x": x})
    np.testing.assert_array_equal(executor.run({"x": x})["y"], _vm(vm, dev, x))
    np.testing.assert_array_equal(executor.run({"x": x})["y"], _vm(vm, dev, x))


def _add_model() -> onnx.ModelProto:
    c = numpy_helper.from_array(np.array([1.0, -2.0, 0.5], np.float32), "c")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"])], "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], [c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_nan_and_inf_pass_through_unchanged(tmp_path):
    onnx.save(_add_model(), str(tmp_path / "add.onnx"))
    grape_tvm.compile_onnx(tmp_path / "add.onnx", {"n": (1, 8)}).export(tmp_path / "add.grape")
    executor = load(tmp_path / "add.grape", "cpu")
    x = np.array([[np.nan, np.inf, -np.inf], [1.0, np.nan, 2.0]], np.float32)
    for _ in range(2):  # recorded, then planned
        y = executor.run({"x": x})["y"]
        want = onnxruntime_outputs(tmp_path / "add.onnx", {"x": x})[0]
        np.testing.assert_array_equal(y, want)  # array_equal treats NaN == NaN position-wise
        assert np.isnan(y[0, 0]) and y[0, 1] == np.inf and y[0, 2] == -np.inf


def test_zero_size_dims_where_the_range_allows_them(tmp_path):
    onnx.save(_add_model(), str(tmp_path / "add.onnx"))
    grape_tvm.compile_onnx(tmp_path / "add.onnx", {"n": (0, 8)}).export(tmp_path / "add.grape")
    executor = load(tmp_path / "add.grape", "cpu")
    for n in (0, 3, 0):
        y = executor.run({"x": np.zeros((n, 3), np.float32)})["y"]
        assert y.shape == (n, 3)
    grape_tvm.compile_onnx(tmp_path / "add.onnx", {"n": (1, 8)}).export(tmp_path / "add1.grape")
    with pytest.raises(grape_tvm.runtime.InputError, match="is 0, outside its declared range 1..8"):
        load(tmp_path / "add1.grape", "cpu").run({"x": np.zeros((0, 3), np.float32)})


@pytest.mark.parametrize("x, message", [
    (np.ones((2, 64), ">f4"), "input 'x' is big-endian (>f4), expected the host's byte order"),
    (np.full((2, 64), None, dtype=object), "input 'x' has dtype object: not an array of numbers"),
    (np.full((2, 64), "a"), "input 'x' has dtype <U1: not an array of numbers"),
    (np.zeros((2, 64), "V4"), "input 'x' has dtype |V4: not an array of numbers"),
])
def test_arrays_tvm_cannot_hold_are_refused_naming_the_input(blocks, x, message):
    with pytest.raises(grape_tvm.runtime.InputError) as err:
        load(blocks[0], "cpu").run({"x": x})
    assert message in str(err.value)


@pytest.mark.parametrize("bounds", [(1.5, 8), (1, 8.0), (1, 1e23), ("1", 8), (True, 8)])
def test_a_range_of_non_integers_is_refused(tmp_path, bounds):
    with pytest.raises(ValueError, match=r"^range of dimension 'n' takes integers, got "):
        grape_tvm.compile_onnx(_add_model(), {"n": bounds})


def test_record_all_names_an_unknown_dim(blocks):
    with pytest.raises(grape_tvm.runtime.InputError) as err:
        load(blocks[0], "cpu").record_all({"m": [1, 2]}, progress=False)
    assert "record_all: ['m'] are not dimensions of the model; its dimensions are ['n']" \
        in str(err.value)


def test_a_range_whose_planned_memory_exceeds_the_limit_is_refused(models):
    """Memory is planned at the upper bound: n = 10**9 would make every call at any n
    allocate 512 GB (std::bad_alloc at each call before it was refused)."""
    with pytest.raises(PlannedMemoryError) as err:
        grape_tvm.compile_onnx(models["blocks"], {"n": (1, 10**9)})
    assert "memory planned at the declared upper bound n=1000000000 is 512000000000 bytes " \
           "(476.8 GiB), above the limit of 68719476736 bytes (64.0 GiB)" in str(err.value)


def test_max_memory_sets_the_limit(models):
    """blocks plans two (n, 64) float32 buffers: 51200 bytes at n = 100."""
    grape_tvm.compile_onnx(models["blocks"], {"n": (1, 100)}, max_memory=51200)
    with pytest.raises(PlannedMemoryError, match=r"is 51200 bytes .*limit of 51199 bytes"):
        grape_tvm.compile_onnx(models["blocks"], {"n": (1, 100)}, max_memory=51199)
