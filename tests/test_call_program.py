"""The call program: written by DescribeCallProgram, evaluated and run by the executor."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import grape_tvm
from grape_tvm.artifact import Artifact, ArtifactError
from grape_tvm.passes.call_program import describe_call_program
from grape_tvm.pipeline import grape_pipeline
from grape_tvm.runtime.call_program import (FORMAT_VERSION, PROGRAM_ATTR, CallProgram,
                                            ProgramError, evaluate)
from grape_tvm.runtime.signature import InputError, ShapeRange


@I.ir_module
class TwoLayers:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), w: R.Tensor((16, 16), "float32")):
        with R.dataflow():
            h = R.nn.relu(R.matmul(x, w))
            y = R.add(R.matmul(h, w), x)
            R.output(y)
        return y


@I.ir_module
class Concat:  # a cache growing by one row: the output's size follows the dim
    @R.function
    def main(cache: R.Tensor(("past", 8), "float32"), x: R.Tensor((1, 8), "float32")):
        with R.dataflow():
            grown = R.concat([cache, x], axis=0)
            y = R.multiply(grown, R.const(2.0, "float32"))
            R.output(grown, y)
        return grown, y


def _lowered(mod, dims):
    ranges = {k: ShapeRange(*v) for k, v in dims.items()}
    return grape_pipeline(tvm.target.Target("llvm"), ranges)(mod)


def test_describe_call_program_on_a_tiny_module():
    """Storages at their planned size, the output's storage sized by the dim, one region
    call with the dims it is recorded under, the output a view of the output storage."""
    lowered = _lowered(TwoLayers, {"n": (1, 32)})
    described = json.loads(str(lowered["main"].attrs[PROGRAM_ATTR]))
    assert described["version"] == FORMAT_VERSION
    assert described["dims"] == {"n": [0, 0]}
    program = CallProgram.from_json(described)
    (step,) = program.steps
    assert step.call == "region" and step.callee.startswith("grape_region_")
    assert step.dims == ("n",)
    assert [a.kind for a in step.args][:2] == ["input", "input"]
    (output,) = program.outputs
    assert output.kind == "view"
    view = program.views[output.index]
    assert view.shape == ("n", 16) and view.dtype == "float32"
    assert program.output_storages == {view.index}
    for n in (1, 7, 32):
        at = program.at({"n": n})
        assert at.storage_bytes[view.index] == n * 16 * 4  # the output: exactly this call's
        assert all(size >= n * 16 * 4 for size in at.storage_bytes)  # planned at n = 32
        assert at.launches[0].shape == (n,)
    assert CallProgram.from_json(program.to_json()).to_json() == program.to_json()


def test_a_host_step_gives_no_program():
    """A function with a binding that is not a storage, view or region call: an error that
    names it, and the executor runs such a model on TVM's VM."""
    lowered = _lowered(TwoLayers, {"n": (1, 32)})
    main = lowered["main"]
    bb = relax.BlockBuilder()
    x = main.params[0]
    with bb.function("main", list(main.params)):
        printed = bb.emit(relax.Call(relax.ExternFunc("vm.builtin.print"), [x]))
        bb.emit_func_output(printed)
    described = describe_call_program(bb.get()["main"], lowered)
    assert "error" in described and "vm.builtin.print" in described["error"]


def test_program_evaluation_and_format_errors():
    program = CallProgram.from_json({
        "version": FORMAT_VERSION, "dims": {"n": [0, 1]}, "derived": [["m", ["//", "n", 2]]],
        "storages": [{"bytes": ["*", 4, ["max", "m", 1]]}],
        "views": [{"storage": 0, "offset": 0, "shape": [["max", "m", 1]], "dtype": "float32"}],
        "steps": [{"call": "region", "callee": "r", "args": [{"input": 0}, {"view": 0},
                                                               {"value": ["-", "n", 1]}],
                   "dims": ["n", "m"]}],
        "outputs": [{"view": 0}, {"shape": ["m", 3]}], "conditionals": {}})
    dims = program.dims_of([(1, 9)])
    assert dims == {"n": 9, "m": 4}
    at = program.at(dims)
    assert at.storage_bytes == (16,)
    assert at.launches[0].shape == (9, 4) and at.launches[0].args[2].value == 8
    assert at.outputs[1].value == (4, 3)
    assert evaluate(["%", ["+", "n", 3], 5], {"n": 9}) == 2
    with pytest.raises(ProgramError, match="version 0.*compile the model again"):
        CallProgram.from_json({**program.to_json(), "version": 0})
    broken = program.to_json()
    broken["views"][0]["shape"] = ["k"]
    with pytest.raises(ProgramError, match="dim 'k' is not defined"):
        CallProgram.from_json(broken)
    broken = program.to_json()
    broken["steps"][0]["args"][1] = {"view": 3}
    with pytest.raises(ProgramError, match="view 3"):
        CallProgram.from_json(broken)


def test_growing_output_equals_the_vm_at_every_length(tmp_path):
    """The output storage's size follows ``past``: grown as the dims grow, every call
    planned, results equal to TVM's VM."""
    module = grape_tvm.build(Concat, {"past": (1, 40)}, "llvm", output_names=["cache", "y"])
    assert module.program is not None
    executor = grape_tvm.load(module.export(tmp_path / "c.grape"), "cpu")
    vm = relax.VirtualMachine(tvm.compile(Concat, "llvm"), tvm.cpu())
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((1, 8)).astype(np.float32)
    for past in range(1, 40):
        x = rng.standard_normal((1, 8)).astype(np.float32)
        got = executor.run({"cache": cache, "x": x})
        want = vm["main"](tvm.runtime.tensor(cache), tvm.runtime.tensor(x))
        np.testing.assert_array_equal(got["cache"], want[0].numpy())
        np.testing.assert_array_equal(got["y"], want[1].numpy())
        assert executor.stats.last["path"] == "planned"
        cache = got["cache"]
    assert executor.stats.planned_calls == 39


def test_an_artifact_without_a_program_runs_on_the_vm(tmp_path):
    """Artifacts written before call programs existed: loaded, run by the VM (regions still
    replayed), results unchanged."""
    module = grape_tvm.build(TwoLayers, {"n": (1, 32)}, "llvm", output_names=["y"])
    path = module.export(tmp_path / "new.grape")
    artifact = Artifact.load(path)
    del artifact.manifest["plan"]["call_program"]
    old = artifact.save(tmp_path / "old.grape")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    with grape_tvm.load(path) as new_ex, grape_tvm.load(old) as old_ex:
        assert old_ex.program is None and new_ex.program is not None
        for n in (3, 3, 32, 1):
            x = rng.standard_normal((n, 16)).astype(np.float32)
            np.testing.assert_array_equal(old_ex.run({"x": x, "w": w})["y"],
                                          new_ex.run({"x": x, "w": w})["y"])
            assert old_ex.stats.last["path"] == "vm"
        assert old_ex.stats.region_replays == 1


def test_a_malformed_program_is_refused_naming_the_artifact(tmp_path):
    module = grape_tvm.build(TwoLayers, {"n": (1, 32)}, "llvm", output_names=["y"])
    artifact = Artifact.load(module.export(tmp_path / "m.grape"))
    artifact.manifest["plan"]["call_program"]["version"] = FORMAT_VERSION + 1
    bad = artifact.save(tmp_path / "bad.grape")
    with pytest.raises(ArtifactError, match="bad.grape.*call program version"):
        grape_tvm.load(bad)


def test_planned_calls_keep_no_memory(tmp_path):
    """The hot path retains nothing per call: 4000 planned calls on device-resident
    inputs leave the traced memory where it was (outputs dropped each time). Traced from
    a warm start: the allocator's first blocks for the call's temporaries are not kept
    per call."""
    module = grape_tvm.build(TwoLayers, {"n": (1, 32)}, "llvm", output_names=["y"])
    executor = grape_tvm.load(module.export(tmp_path / "m.grape"))
    rng = np.random.default_rng(2)
    executor.bind_inputs({"w": rng.standard_normal((16, 16)).astype(np.float32)})
    xs = [tvm.runtime.tensor(rng.standard_normal((n, 16)).astype(np.float32)) for n in (4, 9)]
    for x in xs * 3:  # record, plan, place both sides
        executor.run({"x": x}, return_numpy=False)
    tracemalloc.start()
    try:
        for i in range(2000):
            executor.run({"x": xs[i % 2]}, return_numpy=False)
        before = tracemalloc.take_snapshot()
        for i in range(4000):
            executor.run({"x": xs[i % 2]}, return_numpy=False)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    kept = sum(stat.size_diff for stat in after.compare_to(before, "filename")
               if stat.traceback[0].filename != tracemalloc.__file__)
    assert executor.stats.last["path"] == "planned"
    assert kept < 4096, f"{kept} bytes kept over 4000 calls"


def test_the_executor_keeps_few_caller_tensors_alive(tmp_path):
    """Checked caller tensors are remembered (not checked again when passed again), but
    only the last call's, and 8 small ones (up to 4 MiB) of the calls before: a large
    tensor passed once is let go after the next call, and a caller rotating many small
    ones keeps at most 8 of them alive through the executor."""
    import sys  # pylint: disable=import-outside-toplevel

    from grape_tvm.runtime.executor import RECENT_TENSOR_BYTES, RECENT_TENSORS  # pylint: disable=import-outside-toplevel

    module = grape_tvm.build(TwoLayers, {"n": (1, 1 << 17)}, "llvm", output_names=["y"])
    executor = grape_tvm.load(module.export(tmp_path / "m.grape"))
    rng = np.random.default_rng(3)
    executor.bind_inputs({"w": rng.standard_normal((16, 16)).astype(np.float32)})
    rows = RECENT_TENSOR_BYTES // (16 * 4) + 1  # just over the size kept
    large = tvm.runtime.tensor(np.zeros((rows, 16), np.float32))
    smalls = [tvm.runtime.tensor(np.zeros((2, 16), np.float32)) for _ in range(RECENT_TENSORS + 4)]
    base_large, base_small = sys.getrefcount(large), [sys.getrefcount(t) for t in smalls]
    executor.run({"x": large}, return_numpy=False)
    assert sys.getrefcount(large) > base_large  # the last call's: held
    for small in smalls:
        executor.run({"x": small}, return_numpy=False)
    assert sys.getrefcount(large) == base_large
    after = [sys.getrefcount(t) for t in smalls]  # measured as base_small was
    held = sum(a > b for a, b in zip(after, base_small))
    assert held == RECENT_TENSORS + 1  # the last call's and the 8 before it


def _two_layers_on(backend) -> grape_tvm.runtime.GraphExecutor:
    """An executor of ``TwoLayers`` (n in 1..32) over ``backend``, with its call program."""
    module = grape_tvm.build(TwoLayers, {"n": (1, 32)}, "llvm", output_names=["y"])
    return grape_tvm.runtime.GraphExecutor(module.executable, tvm.cpu(), module.signature,
                                           backend, program=module.program)


def test_bound_inputs_are_placed_once_and_a_new_binding_moves_them(tmp_path):
    """Weights bound with bind_inputs are part of a launch's fixed arguments (not refilled,
    not in ``moving``); binding new ones gives launches a new ``caller``, so a backend that
    patches only moving arguments re-points the weights too."""
    from grape_tvm.runtime.cpu_replay import CpuReplayBackend  # pylint: disable=import-outside-toplevel

    class Recording(CpuReplayBackend):
        def __init__(self, device):
            super().__init__(device)
            self.launched = []

        def replay(self, region, shape, region_args, caller=None, moving=None, guards=()):
            if caller is not None and self.has(region, shape):
                self.launched.append((caller, tuple(moving), list(region_args)))
            return super().replay(region, shape, region_args, caller, moving, guards)

    backend = Recording(tvm.cpu())
    executor = _two_layers_on(backend)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    results = []
    for _ in range(2):
        w = rng.standard_normal((16, 16)).astype(np.float32)
        executor.bind_inputs({"w": w})
        for _ in range(2):
            results.append((executor.run({"x": x})["y"], w))
    (first, moving, args), (second, _, args2) = backend.launched[0], backend.launched[-1]
    assert first != second  # a new binding: a new caller
    w_position = [i for i, a in enumerate(args) if a is not None and
                  tuple(a.shape) == (16, 16)]
    assert w_position and not set(w_position) & set(moving)
    for got, w in results:
        want = np.maximum(x @ w, 0) @ w + x
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_sequence_output_is_one_output_on_the_planned_path(tmp_path):
    """A model whose one output is a sequence (``SplitToSequence``) returns a tuple from its
    entry function: one output, a list of tensors, as on TVM's VM, first call and later."""
    import onnx  # pylint: disable=import-outside-toplevel
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel
    from conftest import onnxruntime_outputs  # pylint: disable=import-outside-toplevel

    graph = helper.make_graph(
        [helper.make_node("SplitToSequence", ["x"], ["seq"], axis=1, keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "seq.onnx"
    onnx.save(model, str(path))
    executor = grape_tvm.load(grape_tvm.compile_onnx(path, {"n": (1, 8)})
                              .export(tmp_path / "seq.grape"))
    rng = np.random.default_rng(4)
    for n in (2, 2, 5, 8):
        x = rng.standard_normal((n, 3)).astype(np.float32)
        got = executor.run({"x": x})
        (want,) = onnxruntime_outputs(path, {"x": x})
        assert list(got) == ["seq"] and len(got["seq"]) == len(want) == 3
        for value, ref in zip(got["seq"], want):
            np.testing.assert_array_equal(value, ref)


def test_planned_calls_keep_no_finished_calls_inputs(tmp_path):
    """Every dims keeps its planned call; none may keep the input tensors of a call that has
    finished (a host array is copied into a new tensor per call: kept, 10000 distinct
    shapes held a gigabyte in bench/memory.py). Only the last call's stay referenced, calls
    made again from what an earlier call kept (on the CPU replay, from argument lists)
    included."""
    module = grape_tvm.build(TwoLayers, {"n": (1, 32)}, "llvm", output_names=["y"])
    executor = grape_tvm.load(module.export(tmp_path / "m.grape"))
    rng = np.random.default_rng(5)
    executor.bind_inputs({"w": rng.standard_normal((16, 16)).astype(np.float32)})

    def placements_holding_inputs() -> tuple[int, int]:
        placements = [p for planned in executor._plans.values()  # pylint: disable=protected-access
                      for p in planned._placed.values()]  # pylint: disable=protected-access
        holding = [p for p in placements
                   if any(launch.values[pos] is not None
                          for launch in p.launches for pos, _ in launch.inputs)]
        return len(placements), len(holding)

    for n in (3, 9, 17, 4):
        executor.run({"x": rng.standard_normal((n, 16)).astype(np.float32)})
    assert placements_holding_inputs() == (4, 1)
    tensors = [tvm.runtime.tensor(rng.standard_normal((n, 16)).astype(np.float32))
               for n in (3, 9, 17)]
    for tensor in tensors * 3 + [tensors[0], tensors[1]]:
        executor.run({"x": tensor}, return_numpy=False)
    assert executor.stats.ready_calls > 3
    assert placements_holding_inputs() == (4, 1)


def _two_layers(x, w):
    return np.maximum(x @ w, 0) @ w + x


def test_a_call_repeating_an_earlier_ones_inputs_is_made_again(tmp_path):
    """A call passing the very tensors of an earlier call, at dims planned and recorded,
    is made again as that call left it (``stats.ready_calls``): on the CPU replay its
    launches replay from their argument lists, filled again when another input set at the
    same dims used them in between. Every output equals numpy's."""
    module = grape_tvm.build(TwoLayers, {"n": (1, 32)}, "llvm", output_names=["y"])
    executor = grape_tvm.load(module.export(tmp_path / "m.grape"))
    rng = np.random.default_rng(6)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    executor.bind_inputs({"w": w})
    xs = [rng.standard_normal((n, 16)).astype(np.float32) for n in (4, 4, 9, 17)]
    tensors = [tvm.runtime.tensor(x) for x in xs]  # two input sets share the dims n = 4
    for pick in rng.integers(0, len(xs) + 1, size=80):
        if pick == len(xs):  # a host array: copied, never made again
            x = rng.standard_normal((4, 16)).astype(np.float32)
            got = executor.run({"x": x})["y"]
        else:
            x = xs[pick]
            got = executor.run({"x": tensors[pick]})["y"]
        np.testing.assert_allclose(got, _two_layers(x, w), rtol=1e-5, atol=1e-5)
    assert executor.stats.ready_calls > 40
    executor.keep_ready_calls, ready_calls = False, executor.stats.ready_calls
    for x, tensor in zip(xs * 2, tensors * 2):  # every call planned and filled
        np.testing.assert_allclose(executor.run({"x": tensor})["y"], _two_layers(x, w),
                                   rtol=1e-5, atol=1e-5)
    assert executor.stats.ready_calls == ready_calls


def test_a_ready_launch_serves_until_the_backend_records_again(tmp_path):
    """The backend's ready launch (``RegionBackend.ready``), kept by a call that repeats an
    earlier one's inputs, makes the next such call's launch; a recording at new dims (which
    may evict or move the backend's recordings), the pool growing or a new binding
    outdates it: the call after replays, and keeps a ready launch anew."""
    from grape_tvm.runtime.cpu_replay import CpuReplayBackend  # pylint: disable=import-outside-toplevel

    class Ready(CpuReplayBackend):  # a ready launch: the replay's arguments, kept
        def __init__(self, device):
            super().__init__(device)
            self.made, self._last = [], None

        def replay(self, region, shape, region_args, caller=None, moving=None, guards=()):
            self._last = (list(region_args), list(guards))
            self.made.append("replay")
            return super().replay(region, shape, region_args, caller, moving, guards)

        def ready(self, region, shape):
            region_args, guards = self._last

            def again():
                self.made.append("ready")
                CpuReplayBackend.replay(self, region, shape, region_args, guards=guards)
            return again

    backend = Ready(tvm.cpu())
    executor = _two_layers_on(backend)
    rng = np.random.default_rng(7)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    executor.bind_inputs({"w": w})
    x4, x9, x30, x31 = (rng.standard_normal((n, 16)).astype(np.float32) for n in (4, 9, 30, 31))
    a, c, big, bigger = (tvm.runtime.tensor(x) for x in (x4, x9, x30, x31))

    def made(tensor, x):
        count = len(backend.made)
        np.testing.assert_allclose(executor.run({"x": tensor})["y"], _two_layers(x, w),
                                   rtol=1e-5, atol=1e-5)
        return backend.made[count:]

    made(big, x30)  # recorded, the pool made for it
    made(a, x4)  # recorded (the VM issues its region)
    assert made(a, x4) == ["replay"] and made(a, x4) == ["ready"] and made(a, x4) == ["ready"]
    # No argument list holds a's tensor: the ready launches read none.
    assert not any(launch.values[position] is not None
                   for planned in executor._plans.values()  # pylint: disable=protected-access
                   for placement in planned._placed.values()  # pylint: disable=protected-access
                   for launch in placement.launches for position, _ in launch.inputs)
    made(c, x9)  # recorded at new dims, on the pool as it was
    assert made(a, x4) == ["replay"] and made(a, x4) == ["ready"]
    made(bigger, x31)  # recorded, on a pool grown for it
    assert made(a, x4) == ["replay"] and made(a, x4) == ["ready"]
    executor._pool.reserve(0, 1 << 20)  # pylint: disable=protected-access
    assert made(a, x4) == ["replay"] and made(a, x4) == ["ready"]  # buffers moved: planned again
    assert made(c, x9) == ["replay"] and made(c, x9) == ["ready"]
    w = rng.standard_normal((16, 16)).astype(np.float32)
    executor.bind_inputs({"w": w})  # forgets the input sets: passed once more, then made again
    assert made(a, x4) == ["replay"] and made(a, x4) == ["replay"] and made(a, x4) == ["ready"]
    assert executor.stats.ready_calls == 7


def test_ready_calls_and_calls_with_out_or_failing_calls_between(tmp_path):
    """A call with ``out=`` between calls made again writes the caller's tensor and leaves
    the ready call returning the executor's own outputs; a call that fails half-way, its
    inputs in the argument lists, leaves them to be filled again: the input set made
    again after it reads its own inputs. Every output equals numpy's."""
    from grape_tvm.runtime.cpu_replay import CpuReplayBackend  # pylint: disable=import-outside-toplevel

    class FailingOnce(CpuReplayBackend):
        fail = False

        def replay(self, region, shape, region_args, caller=None, moving=None, guards=()):
            if self.fail:
                self.fail = False
                raise RuntimeError("replay failed")
            return super().replay(region, shape, region_args, caller, moving, guards)

    backend = FailingOnce(tvm.cpu())
    executor = _two_layers_on(backend)
    rng = np.random.default_rng(8)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    executor.bind_inputs({"w": w})
    xa, xb = (rng.standard_normal((4, 16)).astype(np.float32) for _ in range(2))
    a, b = tvm.runtime.tensor(xa), tvm.runtime.tensor(xb)
    for _ in range(3):
        y = executor.run({"x": a}, return_numpy=False)["y"]
    assert executor.stats.ready_calls == 1
    mine = tvm.runtime.tensor(np.zeros((4, 16), np.float32))
    executor.run({"x": a}, return_numpy=False, out={"y": mine})
    np.testing.assert_allclose(mine.numpy(), _two_layers(xa, w), rtol=1e-5, atol=1e-5)
    again = executor.run({"x": a}, return_numpy=False)["y"]
    assert executor.stats.ready_calls == 2 and again.data_ptr() == y.data_ptr()
    backend.fail = True  # b's inputs filled into the lists a's call made again used
    with pytest.raises(RuntimeError, match="replay failed"):
        executor.run({"x": b})
    np.testing.assert_allclose(executor.run({"x": a})["y"], _two_layers(xa, w),
                               rtol=1e-5, atol=1e-5)
    assert executor.stats.ready_calls == 3
    np.testing.assert_allclose(executor.run({"x": b})["y"], _two_layers(xb, w),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mine.numpy(), _two_layers(xa, w), rtol=1e-5, atol=1e-5)


def test_out_tensors_overlapping_an_input_are_written_by_a_copy(tmp_path):
    """An ``out=`` tensor that is also an input (bound or passed) is written after the call
    by a copy: written directly, the kernels read what they write, and a region recorded
    writing into an input wrote into that argument at every later call. Two outputs given
    one tensor are refused. Every output equals numpy's; the callers' other tensors stay."""
    executor = grape_tvm.load(grape_tvm.build(TwoLayers, {"n": (1, 32)}, "llvm",
                                              output_names=["y"]).export(tmp_path / "m.grape"))
    rng = np.random.default_rng(9)

    def pair(n):
        x, w = rng.standard_normal((n, 16)), rng.standard_normal((16, 16))
        return x.astype(np.float32), w.astype(np.float32)

    x, w = pair(16)
    xt, wt = tvm.runtime.tensor(x), tvm.runtime.tensor(w)
    executor.run({"x": xt, "w": wt}, return_numpy=False, out={"y": wt})  # first call at n = 16
    np.testing.assert_allclose(wt.numpy(), _two_layers(x, w), rtol=1e-5, atol=1e-5)
    assert executor.stats.last["d2d_bytes"] == 16 * 16 * 4
    x, w = pair(16)
    fresh = tvm.runtime.tensor(w)
    np.testing.assert_allclose(executor.run({"x": x, "w": fresh})["y"], _two_layers(x, w),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(fresh.numpy(), w)  # the recording writes no input
    x, w = pair(16)
    xt, wt = tvm.runtime.tensor(x), tvm.runtime.tensor(w)
    for _ in range(2):  # recorded, and the input set passed again
        executor.run({"x": xt, "w": wt})
    executor.run({"x": xt, "w": wt}, return_numpy=False, out={"y": xt})
    np.testing.assert_allclose(xt.numpy(), _two_layers(x, w), rtol=1e-5, atol=1e-5)
    want = _two_layers(xt.numpy(), w)
    mine = xt.numpy()
    again = executor.run({"x": xt, "w": wt}, return_numpy=False)["y"]  # no out=: the pool's
    np.testing.assert_allclose(again.numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(xt.numpy(), mine)
    assert again.data_ptr() != xt.data_ptr()

    executor.bind_inputs({"w": wt})  # a bound input as the out= tensor: copied too
    x = rng.standard_normal((16, 16)).astype(np.float32)
    w = wt.numpy()
    executor.run({"x": x}, return_numpy=False, out={"y": wt})
    np.testing.assert_allclose(wt.numpy(), _two_layers(x, w), rtol=1e-5, atol=1e-5)

    grown = grape_tvm.load(grape_tvm.build(Concat, {"past": (1, 16)}, "llvm",
                                           output_names=["grown", "y"])
                           .export(tmp_path / "c.grape"))
    both = tvm.runtime.tensor(np.zeros((4, 8), np.float32))
    with pytest.raises(InputError, match="share memory"):
        grown.run({"cache": np.ones((3, 8), np.float32), "x": np.ones((1, 8), np.float32)},
                  out={"grown": both, "y": both})


def test_a_call_on_inputs_sharing_memory_is_one_unrecorded_call(tmp_path):
    """One tensor for both inputs: the VM runs the call unrecorded, counted once (the plan's
    check and the VM's call each counted it), and its result equals numpy's."""
    executor = grape_tvm.load(grape_tvm.build(TwoLayers, {"n": (1, 32)}, "llvm",
                                              output_names=["y"]).export(tmp_path / "m.grape"))
    shared = np.random.default_rng(10).standard_normal((16, 16)).astype(np.float32)
    tensor = tvm.runtime.tensor(shared)
    for calls in (1, 2, 3):
        got = executor.run({"x": tensor, "w": tensor})["y"]
        np.testing.assert_allclose(got, _two_layers(shared, shared), rtol=1e-5, atol=1e-5)
        assert executor.stats.unrecorded_calls == calls and executor.stats.last["path"] == "vm"


@I.ir_module
class PassedThrough:  # the input returned as it is, beside a result
    @R.function
    def main(x: R.Tensor(("n", 8), "float32")):
        with R.dataflow():
            y = R.nn.relu(x)
            R.output(y)
        return (y, x)


def test_out_for_an_output_no_kernel_writes_is_a_copy(tmp_path):
    """An input passed through as an output, given an ``out=`` tensor: written after the
    call by a copy (it was refused: no kernel of its own writes it). A target of the wrong
    shape among them is refused before any target is written."""
    executor = grape_tvm.load(grape_tvm.build(PassedThrough, {"n": (1, 16)}, "llvm",
                                              output_names=["y", "same"])
                              .export(tmp_path / "p.grape"))
    rng = np.random.default_rng(11)
    for n in (3, 3, 9):
        x = rng.standard_normal((n, 8)).astype(np.float32)
        y, same = (tvm.runtime.tensor(np.zeros((n, 8), np.float32)) for _ in range(2))
        got = executor.run({"x": x}, return_numpy=False, out={"y": y, "same": same})
        assert got["y"] is y and got["same"] is same
        np.testing.assert_array_equal(y.numpy(), np.maximum(x, 0))
        np.testing.assert_array_equal(same.numpy(), x)
    y, wrong = tvm.runtime.tensor(np.zeros((9, 8), np.float32)), \
        tvm.runtime.tensor(np.zeros((8, 8), np.float32))
    with pytest.raises(InputError, match=r"out\['same'\] is float32\(8, 8\)"):
        executor.run({"x": x}, out={"y": y, "same": wrong})
    assert not y.numpy().any() and not wrong.numpy().any()


def test_out_for_a_shape_output_is_its_numbers(tmp_path):
    """``Shape(x)`` as an output, given an ``out=`` int64 tensor: its numbers copied in (a
    shape value has no tensor's shape or dtype: the copy failed after the call)."""
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel

    info = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Shape", ["x"], ["s"])], "g",
        [info("x", TensorProto.FLOAT, ["n", 8])],
        [info("y", TensorProto.FLOAT, ["n", 8]), info("s", TensorProto.INT64, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    executor = grape_tvm.load(grape_tvm.compile_onnx(model, {"n": (1, 16)})
                              .export(tmp_path / "s.grape"))
    for n in (3, 3, 7):
        x = np.ones((n, 8), np.float32)
        y = tvm.runtime.tensor(np.zeros((n, 8), np.float32))
        shape = tvm.runtime.tensor(np.zeros(2, np.int64))
        executor.run({"x": x}, out={"y": y, "s": shape})
        np.testing.assert_array_equal(shape.numpy(), [n, 8])
        np.testing.assert_array_equal(y.numpy(), x)


@I.ir_module
class EveryOther:  # a dim computed with a division: NameDerivedDims names it on the GPU
    @R.function
    def main(x: R.Tensor((1, "samples", 4), "float32")):
        samples = T.int64()
        with R.dataflow():
            h = R.strided_slice(x, axes=[1], begin=[0], end=[samples], strides=[2],
                                assume_inbound=True)
            y = R.nn.gelu(R.add(h, R.const(1.0, "float32")))
            R.output(y)
        return y


def test_derived_dims_of_a_gpu_build_are_in_the_program():
    """NameDerivedDims casts the derived dims' values through a rank-only shape before it
    names them; the program follows the values through that cast (it used to give up, and
    every call of such a model, Wav2Vec2's, ran on the VM)."""
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    module = grape_tvm.build(EveryOther, {"samples": (8, 64)}, cuda, output_names=["y"],
                             prebuild_cubin=False)
    assert "error" not in module.plan["call_program"], module.plan["call_program"]
    program = module.program
    for samples in (8, 9, 64):
        dims = program.dims_of([(1, samples, 4)])
        assert dims["samples"] == samples
        assert (samples + 1) // 2 in [v for k, v in dims.items() if k != "samples"]
