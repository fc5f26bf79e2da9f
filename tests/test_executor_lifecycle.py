"""Defects of the executor found by using it as a new user would: aliased inputs, bound
inputs passed again, executors that were never freed, shapes held without bound.

Each test compares with an independent reference (numpy) at several shapes.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import tvm

import grape_tvm
from grape_tvm.loader import load
from grape_tvm.runtime import InputError

WIDTH = 16


def _attention_module():
    """``y = softmax(q @ k^T / 4) @ v + q``, ``z = q * k``: three inputs of one shape, so that
    self-attention can pass one tensor for all three."""
    from tvm.script import ir as I  # pylint: disable=import-outside-toplevel
    from tvm.script import relax as R  # pylint: disable=import-outside-toplevel

    @I.ir_module
    class Attention:
        @R.function
        def main(q: R.Tensor(("n", WIDTH), "float32"), k: R.Tensor(("n", WIDTH), "float32"),
                 v: R.Tensor(("n", WIDTH), "float32")):
            with R.dataflow():
                scores = R.multiply(R.matmul(q, R.permute_dims(k)), R.const(0.25, "float32"))
                y = R.add(R.matmul(R.nn.softmax(scores, axis=-1), v), q)
                z = R.multiply(q, k)
                R.output(y, z)
            return (y, z)

    return Attention


def _attention_numpy(q, k, v):
    scores = (q.astype(np.float64) @ k.T.astype(np.float64)) * 0.25
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v + q, q.astype(np.float64) * k


@pytest.fixture(scope="module")
def attention_artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("lifecycle") / "attention.grape"
    grape_tvm.build(_attention_module(), {"n": (1, 32)}, "llvm",
                    output_names=["y", "z"]).export(path)
    return path


def _check(outputs, q, k, v):
    y, z = _attention_numpy(q, k, v)
    np.testing.assert_allclose(outputs["y"], y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outputs["z"], z, rtol=1e-4, atol=1e-4)


def test_one_tensor_for_three_inputs_does_not_poison_the_shape(attention_artifact):
    """Self-attention called with q = k = v first: later calls at those dims with three
    distinct tensors must read each of them (the recording must not map k and v to q)."""
    executor = load(attention_artifact, "cpu")
    rng = np.random.default_rng(0)
    for n in (5, 9):
        shared = rng.standard_normal((n, WIDTH)).astype(np.float32)
        one = tvm.runtime.tensor(shared)
        _check(executor.run({"q": one, "k": one, "v": one}), shared, shared, shared)
        for _ in range(3):  # the planned path at these dims, then the VM path's replays
            q, k, v = (rng.standard_normal((n, WIDTH)).astype(np.float32) for _ in range(3))
            _check(executor.run({"q": q, "k": k, "v": v}), q, k, v)
        for _ in range(2):  # and aliased again, once the dims are planned
            _check(executor.run({"q": one, "k": one, "v": one}), shared, shared, shared)


def _aligned_rows(rows: np.ndarray) -> np.ndarray:
    """A copy of ``rows`` whose data starts on a 64-byte boundary (TVM's kernels need it)."""
    raw = np.zeros(rows.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    aligned = raw[start:start + rows.nbytes].view(rows.dtype).reshape(rows.shape)
    aligned[...] = rows
    return aligned


def test_overlapping_views_as_two_inputs_are_read_as_passed(attention_artifact):
    """q and k overlapping views of one buffer, read in place through DLPack (k starts one
    row into q): the recording made on them must not stand for calls on separate tensors."""
    executor = load(attention_artifact, "cpu")
    rng = np.random.default_rng(1)
    n = 6
    rows = _aligned_rows(rng.standard_normal((n + 1, WIDTH)).astype(np.float32))
    q_view, k_view = rows[:n], rows[1:]  # WIDTH * 4 = 64 bytes apart: both aligned
    v = rng.standard_normal((n, WIDTH)).astype(np.float32)
    in_place = {"q": tvm.runtime.from_dlpack(q_view), "k": tvm.runtime.from_dlpack(k_view), "v": v}
    _check(executor.run(in_place), q_view, k_view, v)
    for _ in range(2):
        q, k = (rng.standard_normal((n, WIDTH)).astype(np.float32) for _ in range(2))
        _check(executor.run({"q": q, "k": k, "v": v}), q, k, v)
    _check(executor.run(in_place), q_view, k_view, v)


def test_a_bound_input_passed_to_run_is_refused(tmp_path):
    """A bound input passed again would be kept by the first call's plan at those dims and
    read by later calls that omit it: refused, naming the input, before any kernel runs."""
    path = tmp_path / "attention.grape"
    grape_tvm.build(_attention_module(), {"n": (1, 32)}, "llvm",
                    output_names=["y", "z"]).export(path)
    executor = load(path, "cpu")
    rng = np.random.default_rng(2)
    v_bound = rng.standard_normal((4, WIDTH)).astype(np.float32)
    executor.bind_inputs({"v": v_bound})
    q, k = (rng.standard_normal((4, WIDTH)).astype(np.float32) for _ in range(2))
    with pytest.raises(InputError, match=r"input 'v' is bound \(bind_inputs\)"):
        executor.run({"q": q, "k": k, "v": np.zeros((4, WIDTH), np.float32)})
    assert executor.stats.calls == 0
    for _ in range(3):
        _check(executor.run({"q": q, "k": k}), q, k, v_bound)


def _collected(make) -> bool:
    ref = make()
    gc.collect()
    return ref() is None


def test_a_dropped_executor_is_collected(attention_artifact):
    """The VM holds the executor's instrument callback: that must not keep the executor
    (and its VM, buffers and graphs) alive once the caller drops it."""
    def run_and_drop():
        executor = load(attention_artifact, "cpu")
        q = np.ones((3, WIDTH), np.float32)
        executor.run({"q": q, "k": q, "v": q})
        executor.run({"q": q, "k": q, "v": q})
        return weakref.ref(executor)

    def closed_with_block():
        with load(attention_artifact, "cpu") as executor:
            q = np.ones((3, WIDTH), np.float32)
            executor.run({"q": q, "k": q, "v": q})
        return weakref.ref(executor)

    assert _collected(run_and_drop)
    assert _collected(closed_with_block)


def test_a_closed_executor_releases_everything_and_refuses_calls(attention_artifact):
    executor = load(attention_artifact, "cpu")
    q = np.ones((3, WIDTH), np.float32)
    executor.run({"q": q, "k": q, "v": q})
    executor.run({"q": q, "k": q, "v": q})
    assert executor.stats.plans_held == 1 and executor.stats.shapes_held >= 1
    executor.close()
    assert executor.stats.plans_held == 0 and executor.stats.shapes_held == 0
    assert executor.backend.shapes_held == 0
    with pytest.raises(RuntimeError, match="closed"):
        executor.run({"q": q, "k": q, "v": q})
    executor.close()  # twice is harmless


def test_plans_and_recordings_are_bounded_least_recently_used_first(attention_artifact):
    """``max_shapes`` bounds what the executor keeps per shape; an evicted shape is recorded
    again when it comes back, and equals the reference every time."""
    executor = load(attention_artifact, "cpu", max_shapes=4)
    rng = np.random.default_rng(3)
    sizes = [1, 2, 3, 4, 5, 6, 1, 7, 2, 8, 3, 3, 32, 1]
    for n in sizes * 2:
        q, k, v = (rng.standard_normal((n, WIDTH)).astype(np.float32) for _ in range(3))
        _check(executor.run({"q": q, "k": k, "v": v}), q, k, v)
        assert executor.stats.plans_held <= 4
        assert executor.stats.shapes_held <= 4 * len(executor.backend.recorded_shapes())
    assert executor.stats.evicted_shapes > 0 and executor.backend.evicted > 0
    assert executor.stats.planned_calls > 0


def test_threads_loading_one_artifact_share_one_library(monkeypatch, tmp_path):
    """Workers of a threaded session load the same artifact at once: its library is loaded
    once and shared (TVM keeps host memory per load, ``loader._LIBRARIES``), not once per
    thread that found the cache empty."""
    import threading  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel

    from grape_tvm import loader  # pylint: disable=import-outside-toplevel

    path = tmp_path / "lib.so"
    loads = []

    def slow_load(name):  # long enough for every thread to find the cache empty
        loads.append(name)
        time.sleep(0.05)
        return object()

    monkeypatch.setattr(loader, "_library_path", lambda artifact: path)
    monkeypatch.setattr(loader.tvm.runtime, "load_module", slow_load)
    monkeypatch.setattr(loader, "_LIBRARIES", {})
    got = []
    threads = [threading.Thread(target=lambda: got.append(loader._library(None)))  # pylint: disable=protected-access
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert loads == [str(path)] and len(got) == 4 and all(g is got[0] for g in got)
