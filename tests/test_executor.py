"""The executor on the CPU: region recordings replayed instead of the VM, checked against it."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine
from tvm.script import ir as I
from tvm.script import relax as R

import grape_tvm
from grape_tvm.loader import load, load_library
from grape_tvm.runtime import GraphExecutor, InputError


@pytest.fixture(scope="module")
def blocks_artifact(models, tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "blocks.grape"
    grape_tvm.compile_onnx(models["blocks"], dims={"n": (1, 64)}, target="llvm").export(path)
    return path


def test_replay_equals_vm_for_many_shapes_in_random_order(blocks_artifact):
    library, _, dev = load_library(blocks_artifact, "cpu")
    vm = VirtualMachine(library, dev)
    executor = load(blocks_artifact, "cpu")
    rng = np.random.default_rng(0)
    shapes = rng.integers(1, 65, size=120)
    for n in shapes:
        x = rng.standard_normal((int(n), 64)).astype(np.float32)
        got = executor.run({"x": x})["y"]
        want = vm["main"](tvm.runtime.tensor(x, dev)).numpy()
        np.testing.assert_array_equal(got, want)  # same kernels, same order: bit-equal
    distinct = len(set(shapes.tolist()))
    assert executor.stats.region_recordings == distinct
    assert executor.stats.region_replays == len(shapes) - distinct
    assert sorted(executor.recorded_shapes["grape_region_0"]) == sorted((int(n),) for n in set(shapes.tolist()))


def test_a_seen_shape_runs_without_the_vm(blocks_artifact):
    """No host step in this model: every call is planned from the call program; at a
    recorded shape the VM is not touched at all."""
    executor = load(blocks_artifact, "cpu")
    x = np.ones((5, 64), np.float32)
    first = executor.run({"x": x})["y"]
    group = executor.backend.group("grape_region_0", (5,))
    assert group.names == executor.manifest["plan"]["regions"][0]["kernels"]
    seen = []
    executor._vm.set_instrument(  # pylint: disable=protected-access
        lambda f, sym, before, ret, *a: seen.append(sym) or executor._instrument(f, sym, before, ret, *a))
    np.testing.assert_array_equal(executor.run({"x": x * 2})["y"],
                                  load(blocks_artifact, "cpu").run({"x": x * 2})["y"])
    assert seen == [] and executor.stats.planned_calls == 2
    assert not np.array_equal(first, executor.run({"x": x * 3})["y"])


def test_outputs_fed_back_as_inputs_are_read_in_place(blocks_artifact):
    """The last call's output lives in the executor's buffers: the next call writes its
    outputs on the other side and reads the old ones where they are."""
    import tvm  # pylint: disable=import-outside-toplevel

    executor = load(blocks_artifact, "cpu")
    reference = load(blocks_artifact, "cpu")
    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    y = executor.run({"x": x}, return_numpy=False)["y"]
    y = executor.run({"x": x}, return_numpy=False)["y"]  # planned: y is a pool buffer now
    want = reference.run({"x": x})["y"]  # y = f(x), twice the same call
    for _ in range(4):
        z = executor.run({"x": y}, return_numpy=False)["y"]
        assert executor.stats.last["path"] == "planned"
        assert executor.stats.last["h2d_bytes"] == 0 and executor.stats.last["d2d_bytes"] == 0
        assert z.data_ptr() != y.data_ptr()
        want = reference.run({"x": want})["y"]
        np.testing.assert_allclose(z.numpy(), want, rtol=1e-5, atol=1e-5)
        y = z
    assert isinstance(y, tvm.runtime.Tensor)


def test_out_buffers_are_written_directly(blocks_artifact):
    import tvm  # pylint: disable=import-outside-toplevel

    executor = load(blocks_artifact, "cpu")
    x = np.random.default_rng(1).standard_normal((7, 64)).astype(np.float32)
    want = load(blocks_artifact, "cpu").run({"x": x})["y"]
    for _ in range(2):  # the first call records the region into out=, the second replays
        target = tvm.runtime.empty((7, 64), "float32", tvm.cpu())
        got = executor.run({"x": x}, out={"y": target}, return_numpy=False)["y"]
        last = executor.stats.last
        assert (last["h2d_bytes"], last["d2h_bytes"], last["d2d_bytes"], last["path"]) == \
            (x.nbytes, 0, 0, "planned")
        assert got.data_ptr() == target.data_ptr()
        np.testing.assert_allclose(target.numpy(), want, rtol=1e-6, atol=1e-6)
    y = executor.run({"x": x}, return_numpy=False)["y"]  # the pool's buffer again
    assert y.data_ptr() != target.data_ptr()
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(InputError, match=r"out\['y'\] is float32\(8, 64\), this call's output is float32\(7, 64\)"):
        executor.run({"x": x}, out={"y": tvm.runtime.empty((8, 64), "float32", tvm.cpu())})
    with pytest.raises(InputError, match="unknown output"):
        executor.run({"x": x}, out={"z": target})
    strided = np.zeros((64, 7), np.float32).T  # a DLPack tensor, but not dense row-major
    with pytest.raises(ValueError, match="cannot be read in place: it is not contiguous"):
        executor.run({"x": x}, out={"y": strided})
    with pytest.raises(ValueError, match=r"out\['y'\]. cannot be written in place: .*not aligned to 64"):
        executor.run({"x": x}, out={"y": _misaligned(np.zeros((7, 64), np.float32))})


class _DLPackOnly:
    """A DLPack producer that is not a numpy array (numpy inputs take the copying path)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def _misaligned(array: np.ndarray, offset: int = 4) -> _DLPackOnly:
    """``array``'s values in memory that starts ``offset`` bytes past a 64-byte boundary."""
    raw = np.zeros(array.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    view = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    view[...] = array
    assert view.ctypes.data % 64 == offset
    return _DLPackOnly(view)


def test_misaligned_input_is_copied_once_and_counted(blocks_artifact):
    """TVM's kernels assume 64-byte aligned data: a misaligned DLPack input is copied into an
    aligned buffer (counted), never read misaligned and never refused."""
    executor = load(blocks_artifact, "cpu")
    x = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)
    want = load(blocks_artifact, "cpu").run({"x": x})["y"]
    executor.run({"x": _misaligned(x, offset=0)})  # aligned: read where it is
    assert executor.stats.last["h2d_bytes"] == 0
    got = executor.run({"x": _misaligned(x)})["y"]
    assert executor.stats.last["h2d_bytes"] == x.nbytes
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _growing_cache_step():
    """``cache' = concat(cache, x)``, ``y = cache' * 2``: a decode step's cache, in small."""
    from tvm.script import ir as I  # pylint: disable=import-outside-toplevel
    from tvm.script import relax as R  # pylint: disable=import-outside-toplevel

    @I.ir_module
    class Step:
        @R.function
        def main(cache: R.Tensor(("past", 8), "float32"), x: R.Tensor((1, 8), "float32")):
            with R.dataflow():
                grown = R.concat((cache, x), axis=0)
                y = R.multiply(grown, R.const(2.0, "float32"))
                R.output(grown, y)
            return (grown, y)

    return Step


def test_a_growing_cache_fed_back_copies_nothing(tmp_path):
    """A decode-style loop: ``cache' = concat(cache, x)``, ``y = cache' * 2``, the cache fed
    back each call and growing by one row: after recording, no byte is copied."""
    Step = _growing_cache_step()
    path = tmp_path / "step.grape"
    grape_tvm.build(Step, {"past": (1, 40)}, "llvm", output_names=["cache", "y"]).export(path)
    executor = load(path, "cpu")
    rng = np.random.default_rng(0)
    xs = [tvm.runtime.tensor(rng.standard_normal((1, 8)).astype(np.float32)) for _ in range(39)]
    start = tvm.runtime.tensor(rng.standard_normal((1, 8)).astype(np.float32))
    for _ in range(2):  # first pass records every length, the second replays them
        cache, want = start, start.numpy()
        before = (executor.stats.h2d_bytes, executor.stats.d2d_bytes, executor.stats.d2h_bytes)
        for x in xs:
            out = executor.run({"cache": cache, "x": x}, return_numpy=False)
            want = np.concatenate([want, x.numpy()])
            cache = out["cache"]
        np.testing.assert_array_equal(cache.numpy(), want)
        np.testing.assert_array_equal(out["y"].numpy(), want * 2)
    assert (executor.stats.h2d_bytes, executor.stats.d2d_bytes, executor.stats.d2h_bytes) == before
    assert executor.stats.planned_calls == 2 * len(xs)
    assert executor.stats.region_replays == executor.stats.region_recordings == len(xs)


def test_planned_decode_steps_share_their_address_lists(tmp_path):
    """What a CUDA graph backend (``addresses_only``) gets from planned calls of a growing
    cache fed back: executor buffers as addresses, one argument list for every past length
    (only inputs, outputs' side and dims passed by value differ), one ``caller`` key, and
    outputs alternating between two sides. The stub records the replays of recorded shapes
    (without running them: it gets addresses) and lets the CPU replay record new ones."""
    from grape_tvm.runtime.call_plan import Address  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime.cpu_replay import CpuReplayBackend  # pylint: disable=import-outside-toplevel

    class AddressesOnly(CpuReplayBackend):
        addresses_only = True

        def __init__(self, device):
            super().__init__(device)
            self.planned = []

        def replay(self, region, shape, region_args, caller=None, moving=None, guards=()):
            if not self.has(region, shape):
                return False  # the executor records it (the VM issues it, on tensors)
            self.planned.append((shape, list(region_args), caller, list(moving)))
            return True

    Step = _growing_cache_step()
    module = grape_tvm.build(Step, {"past": (1, 20)}, "llvm", output_names=["cache", "y"])
    backend = AddressesOnly(tvm.cpu())
    executor = GraphExecutor(module.executable, tvm.cpu(), module.signature, backend,
                             program=module.program)
    x = tvm.runtime.tensor(np.ones((1, 8), np.float32))
    start = tvm.runtime.tensor(np.ones((1, 8), np.float32))
    for _ in range(2):  # the first pass records every length, the second replays
        cache, sides = start, []
        for _ in range(19):
            cache = executor.run({"cache": cache, "x": x}, return_numpy=False)["cache"]
            sides.append(cache.data_ptr())
    assert executor.stats.planned_calls == 2 * len(backend.planned) == 38
    assert len(set(sides)) == 2 and sides[0::2] == [sides[0]] * 10  # two sides, alternating
    assert len({caller for _, _, caller, _ in backend.planned}) == 1
    # The executor's own buffers, as addresses: the same for every past length on a side.
    lists = [[a for a in args if isinstance(a, Address)] for _, args, _, _ in backend.planned]
    assert lists[0] and lists[0] != lists[1]
    assert lists[0::2] == [lists[0]] * 10 and lists[1::2] == [lists[1]] * 9
    assert [shape for shape, _, _, _ in backend.planned] != [backend.planned[0][0]] * 19
    assert (executor.stats.h2d_bytes, executor.stats.d2d_bytes) == (0, 0)


def test_bad_inputs_fail_before_any_kernel_and_leave_the_executor_usable(blocks_artifact):
    executor = load(blocks_artifact, "cpu")
    cases = [
        ({"x": np.zeros((65, 64), np.float32)}, "input 'x' axis 0 (dimension 'n') is 65, outside its declared range 1..64"),
        ({"x": np.zeros((0, 64), np.float32)}, "is 0, outside its declared range 1..64"),
        ({"x": np.zeros((4, 63), np.float32)}, "input 'x' axis 1 is 63, expected 64"),
        ({"x": np.zeros((4, 64), np.float16)}, "input 'x' has dtype float16, expected float32"),
        ({"x": np.zeros((4, 64, 1), np.float32)}, "input 'x' has rank 3"),
        ({}, "missing input(s) ['x']"),
        ({"x": np.zeros((4, 64), np.float32), "z": np.zeros(1)}, "unknown input(s) ['z']"),
    ]
    for inputs, message in cases:
        with pytest.raises(InputError) as err:
            executor.run(inputs)
        assert message in str(err.value)
    assert executor.stats.calls == 0 and executor.stats.region_recordings == 0
    assert executor.run({"x": np.ones((4, 64), np.float32)})["y"].shape == (4, 64)


def test_dims_shared_by_two_inputs_must_agree(models, tmp_path):
    path = tmp_path / "two.grape"
    grape_tvm.compile_onnx(models["two_inputs"], dims={"b": (1, 4), "n": (1, 32)}).export(path)
    executor = load(path, "cpu")
    with pytest.raises(InputError, match="dimension 'n'.* is 5, but another input set 'n' to 6"):
        executor.run({"x": np.zeros((2, 6, 8), np.float32), "mask": np.zeros((2, 5), np.float32)})


def test_input_that_is_not_an_array_is_refused(blocks_artifact):
    executor = load(blocks_artifact, "cpu")
    x = tvm.runtime.tensor(np.ones((4, 64), np.float32))
    ok = executor.run({"x": x})["y"]
    assert ok.shape == (4, 64)
    with pytest.raises(TypeError, match="input 'x': expected a numpy array or a DLPack tensor"):
        executor.run({"x": [[1.0] * 64]})


def test_tvm_compile_with_the_grape_pipeline_runs_in_the_executor():
    import grape_tvm.pipeline  # noqa: F401  registers "grape"  pylint: disable=import-outside-toplevel
    from tvm.script import ir as I  # pylint: disable=import-outside-toplevel
    from tvm.script import relax as R  # pylint: disable=import-outside-toplevel

    @I.ir_module
    class Model:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32"), w: R.Tensor((8, 8), "float32")):
            R.func_attr({"tir_var_upper_bound": {"n": 32}})
            with R.dataflow():
                y = R.nn.relu(R.matmul(x, w))
                R.output(y)
            return y

    ex = tvm.compile(Model, target=tvm.target.Target({"kind": "llvm"}), relax_pipeline="grape")
    executor = GraphExecutor(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    for n in (3, 32, 3, 1):
        x = rng.standard_normal((n, 8)).astype(np.float32)
        np.testing.assert_allclose(executor.run([x, w])[0], np.maximum(x @ w, 0), rtol=1e-5, atol=1e-5)
    assert executor.stats.region_replays == 1 and executor.stats.region_recordings == 3


def test_bound_inputs_are_checked_once_and_left_out_of_calls(tmp_path):
    import sys  # pylint: disable=import-outside-toplevel
    from pathlib import Path  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from models import block_weights, blocks_numpy, blocks_relax  # pylint: disable=import-outside-toplevel

    path = tmp_path / "b.grape"
    grape_tvm.build(blocks_relax(32, 2), {"n": (1, 16)}, "llvm", output_names=["y"]).export(path)
    weights = block_weights(32, 2)
    executor = load(path, "cpu")
    with pytest.raises(InputError, match="input 'w0' axis 0 is 31, expected 32"):
        executor.bind_inputs({"w0": np.zeros((31, 32), np.float32)})
    with pytest.raises(InputError, match="unknown input"):
        executor.bind_inputs({"nope": np.zeros(1, np.float32)})
    executor.bind_inputs(weights)
    rng = np.random.default_rng(0)
    for n in (3, 16, 3, 1, 16):
        x = rng.standard_normal((n, 32)).astype(np.float32)
        np.testing.assert_allclose(executor.run({"x": x})["y"], blocks_numpy(x, weights, 2),
                                   rtol=1e-4, atol=1e-4)
    assert executor.stats.planned_calls == 5 and executor.stats.region_replays == 2
    with pytest.raises(InputError, match="missing input"):
        executor.run({})


def test_inputs_bound_one_at_a_time_must_agree_on_their_dims(tmp_path):
    """x (n, 8) and m (n, 4) bound, then x alone again at another n: refused, naming the
    dim (it was taken, and the call after read 7 rows of a 5-row m, or failed in TVM).
    Binding both again, at any n in range, is a new binding; every call equals numpy."""
    @I.ir_module
    class Affine:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32"), m: R.Tensor(("n", 4), "float32"),
                 w: R.Tensor((8, 4), "float32")):
            with R.dataflow():
                y = R.add(R.matmul(x, w), m)
                R.output(y)
            return y

    executor = load(grape_tvm.build(Affine, {"n": (1, 16)}, "llvm", output_names=["y"])
                    .export(tmp_path / "affine.grape"))
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    xs = {n: rng.standard_normal((n, 8)).astype(np.float32) for n in (5, 7)}
    ms = {n: rng.standard_normal((n, 4)).astype(np.float32) for n in (5, 7)}
    for n in (7, 5):
        executor.bind_inputs({"x": xs[n], "m": ms[n]})
        np.testing.assert_allclose(executor.run({"w": w})["y"], xs[n] @ w + ms[n], rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="'n'"):
        executor.bind_inputs({"x": xs[7]})
    np.testing.assert_allclose(executor.run({"w": w})["y"], xs[5] @ w + ms[5], rtol=1e-5, atol=1e-5)
    executor.bind_inputs({"m": ms[5] + 1})  # the same n: taken
    np.testing.assert_allclose(executor.run({"w": w})["y"], xs[5] @ w + ms[5] + 1, rtol=1e-5, atol=1e-5)



def test_a_bound_device_tensor_is_read_where_it_is_and_a_host_array_copied(tmp_path):
    """As bind_inputs says: a host array is copied once (changing it later changes
    nothing); a device tensor is read in place (changing it changes the next call)."""
    executor = load(grape_tvm.build(_Product, {"n": (1, 8)}, "llvm", output_names=["y"])
                    .export(tmp_path / "w.grape"))
    rng = np.random.default_rng(8)
    x, w = (rng.standard_normal((3, 4)).astype(np.float32),
            rng.standard_normal((4, 4)).astype(np.float32))
    host = w.copy()
    executor.bind_inputs({"w": host})
    host *= 2  # the executor's copy stays
    np.testing.assert_allclose(executor.run({"x": x})["y"], x @ w, rtol=1e-5, atol=1e-5)
    device = tvm.runtime.tensor(w)
    executor.bind_inputs({"w": device})
    np.testing.assert_allclose(executor.run({"x": x})["y"], x @ w, rtol=1e-5, atol=1e-5)
    device.copyfrom(2 * w)
    np.testing.assert_allclose(executor.run({"x": x})["y"], x @ (2 * w), rtol=1e-5, atol=1e-5)
    executor.close()


@I.ir_module
class _Product:
    @R.function
    def main(x: R.Tensor(("n", 4), "float32"), w: R.Tensor((4, 4), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            R.output(y)
        return y
