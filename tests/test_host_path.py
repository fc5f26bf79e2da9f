"""A call's host path at dims seen before, on the CPU: the input sets the executor
remembers, and the launch record each call hands the CUDA backend's graphs (their Python
run here with the driver stubbed: every copy the device would get is read back)."""

from __future__ import annotations

import ctypes
import struct
import sys
from collections import OrderedDict

import numpy as np
import pytest
import tvm

import grape_tvm
from grape_tvm.runtime import GraphExecutor, topology_graph
from grape_tvm.runtime.call_plan import Address
from grape_tvm.runtime.cpu_replay import CpuReplayBackend
from grape_tvm.runtime.cuda_backend import CudaGraphBackend, _RegionGraphs
from grape_tvm.runtime.cuda_driver import driver as real_driver
from grape_tvm.runtime.executor import RECENT_TENSORS
from grape_tvm.runtime.topology_graph import LaunchRecord, TopologyGraph
from test_call_program import TwoLayers


def _want(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.maximum(x @ w, 0) @ w + x


@pytest.fixture(scope="module")
def module():
    return grape_tvm.build(TwoLayers, {"n": (1, 32)}, "llvm", output_names=["y"])


def _tensor(rng, *shape):
    return tvm.runtime.tensor(rng.standard_normal(shape).astype(np.float32))


def test_input_sets_rotated_are_read_where_they_are_now(module, tmp_path):
    """A caller keeping one input per shape, rotating them: each call reads its own input
    as it is now (changed in place since, or a new tensor at a shape seen before), never
    what an earlier call at those dims read."""
    executor = grape_tvm.load(module.export(tmp_path / "m.grape"))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    executor.bind_inputs({"w": w})
    xs = {n: _tensor(rng, n, 16) for n in (3, 7, 12)}
    for step in range(12):
        n = (3, 7, 12)[step % 3]
        if step == 6:
            xs[7] = _tensor(rng, 7, 16)  # a new tensor (new address) at dims seen before
        if step == 9:
            xs[3].copyfrom(rng.standard_normal((3, 16)).astype(np.float32))  # new contents
        got = executor.run({"x": xs[n]})["y"]
        np.testing.assert_allclose(got, _want(xs[n].numpy(), w), rtol=1e-5, atol=1e-5)
        assert executor.stats.last["path"] == "planned"


def test_remembered_input_sets_keep_no_more_tensors_alive(module, tmp_path):
    """Input sets of two tensors each, rotated: the sets remembered hold no tensor beyond
    the last call's and the ``RECENT_TENSORS`` small ones of the calls before (as when
    only single tensors were remembered), and every call reads its own pair."""
    executor = grape_tvm.load(module.export(tmp_path / "m.grape"))
    rng = np.random.default_rng(1)
    for n in range(2, 7):  # recorded first: the calls below are replays at dims seen
        executor.run({"x": _tensor(rng, n, 16), "w": _tensor(rng, 16, 16)})
    pairs = [(_tensor(rng, 2 + i % 5, 16), _tensor(rng, 16, 16)) for i in range(12)]
    tensors = [t for pair in pairs for t in pair]
    base = [sys.getrefcount(t) for t in tensors]
    order = list(range(12)) + [8, 9, 10, 11] * 3 + [0, 11, 1]
    for i in order:
        got = executor.run({"x": pairs[i][0], "w": pairs[i][1]})["y"]
        want = _want(pairs[i][0].numpy(), pairs[i][1].numpy())
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    after = [sys.getrefcount(t) for t in tensors]  # measured as base was
    held = [i for i, (a, b) in enumerate(zip(after, base)) if a > b]
    # The last call's pair (1) and the 8 tensors of the calls before it: 11, 0, 10, 9.
    assert held == sorted(2 * i + k for i in (1, 11, 0, 10, 9) for k in (0, 1))
    assert len(held) == RECENT_TENSORS + 2


def test_a_remembered_input_set_is_matched_whole(module, tmp_path):
    """An input set is found by its first value, then compared whole: the same x with
    another w, or under names given in another order, is a call of its own."""
    executor = grape_tvm.load(module.export(tmp_path / "m.grape"))
    rng = np.random.default_rng(3)
    x, y = _tensor(rng, 5, 16), _tensor(rng, 5, 16)
    w1, w2 = _tensor(rng, 16, 16), _tensor(rng, 16, 16)
    for inputs in ({"x": x, "w": w1}, {"x": y, "w": w1}, {"x": x, "w": w2},
                   {"x": y, "w": w1}, {"w": w1, "x": x}, {"x": y, "w": w2}, {"x": x, "w": w1}):
        got = executor.run(inputs)["y"]
        want = _want(inputs["x"].numpy(), inputs["w"].numpy())
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_point_writes_the_row_and_the_addresses_that_moved():
    """``LaunchRecord.point``: the row and the addresses of the positions named, each an
    executor buffer's ``Address``, a tensor or a dim by value (no address: 0); it gives
    the bytes to copy from ``address`` when something changed, else 0."""
    class Tensor:
        def __init__(self, address):
            self.address = address

        def data_ptr(self):
            return self.address

    record = LaunchRecord(3)
    record.take()  # the device got the empty record at construction
    x = Tensor(0x2000)
    args = [Address(0x1000), x, 7]
    copied = record.point(5, args, range(3))
    assert copied == record.used_bytes == 16 + 3 * 8
    assert ctypes.string_at(record.address, copied) == record.used()
    assert struct.unpack("<II8x3Q", record.used()) == (5, 0, 0x1000, 0x2000, 0)
    assert record.point(5, args, range(3)) == 0  # nothing moved: no copy
    x.address = 0x3000  # the same dims, an input somewhere else
    assert record.point(5, args, [1]) == copied
    assert struct.unpack("<II8x3Q", ctypes.string_at(record.address, copied)) == \
        (5, 0, 0x1000, 0x3000, 0)
    assert record.point(6, args, [1]) == copied  # another row, the input where it was
    assert struct.unpack("<II8x3Q", ctypes.string_at(record.address, copied))[:3] == (6, 0, 0x1000)
    record.set_guards([(0xA0, 1)])  # a guard came: copied with the next call's record
    guarded = record.point(6, args, [1])
    assert guarded == copied + 16 and record.take() == 0
    assert struct.unpack_from("<QQ", ctypes.string_at(record.address, guarded), copied) == (0xA0, 1)


class _StubDriver:
    """What a topology graph's replay calls of the driver, kept: the bytes of each launch
    record copy (read from the host address given, as the driver stages them) and each
    launch."""

    CUresult = real_driver.CUresult

    def __init__(self):
        self.copies: list[bytes] = []
        self.launches = 0

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):  # noqa: N802 (the driver's name)
        self.copies.append(ctypes.string_at(src, nbytes))
        return (real_driver.CUresult.CUDA_SUCCESS,)

    def cuGraphLaunch(self, graph_exec, stream):  # noqa: N802
        self.launches += 1
        return (real_driver.CUresult.CUDA_SUCCESS,)


class _TopologyReplay(CpuReplayBackend):
    """The CUDA backend's replay (``CudaGraphBackend.replay``, ``TopologyGraph``'s launch
    records) over the CPU replay's recordings and argument tables: graphs without a GPU,
    holding only what a call touches."""

    addresses_only = True
    replay = CudaGraphBackend.replay  # an unrecorded shape: False, the CPU replay records it

    def __init__(self, device):
        super().__init__(device)
        self._regions: dict[str, _RegionGraphs] = {}
        self._per_shape: OrderedDict = OrderedDict()
        self.stream = None

    def end(self, recorder, run: bool = True) -> None:
        super().end(recorder, run)
        groups = self._groups[recorder.region]
        region = self._regions.setdefault(recorder.region, _RegionGraphs(groups, []))
        while len(region.graphs) < len(groups.tables):
            graph = object.__new__(TopologyGraph)  # no CUgraph: what replay touches
            graph.num_args = len(recorder.region_args)
            graph.exec = object()
            graph._launch = LaunchRecord(graph.num_args)  # pylint: disable=protected-access
            graph._launch.take()  # written at construction, as TopologyGraph does
            graph._launch_device = 0x7000  # pylint: disable=protected-access
            graph._last_caller = None  # pylint: disable=protected-access
            graph._reading = None  # pylint: disable=protected-access  # the launch buffer
            region.graphs.append(graph)


def test_every_call_leaves_the_device_its_own_row_and_input(module, monkeypatch):
    """Calls rotating among remembered inputs at dims seen before, with a new tensor at a
    seen n among them: after each call the launch record the device holds (the last copy)
    has the row of the call's n and the addresses of its own input and output; a call that
    changes nothing copies nothing, one whose input moved copies again."""
    stub = _StubDriver()
    monkeypatch.setattr(topology_graph, "driver", stub)
    backend = _TopologyReplay(tvm.cpu())
    executor = GraphExecutor(module.executable, tvm.cpu(), module.signature, backend,
                             program=module.program)
    rng = np.random.default_rng(2)
    executor.bind_inputs({"w": rng.standard_normal((16, 16)).astype(np.float32)})
    xs = {n: _tensor(rng, n, 16) for n in (4, 9, 17)}
    for n in xs:  # recorded (by the CPU replay), then replayed below
        executor.run({"x": xs[n]}, return_numpy=False)
    kept = list(xs.values())  # no address freed and given to a later tensor
    # (n, a new tensor at that n): rotating, repeating, and moving an input at a seen n.
    steps = [(4, False), (9, False), (17, False), (9, False), (9, False), (4, False),
             (9, True), (17, False), (9, False), (9, True), (9, False), (4, False)]
    previous = None
    for n, new in steps:
        if new:
            xs[n] = _tensor(rng, n, 16)
            kept.append(xs[n])
        copies = len(stub.copies)
        y = executor.run({"x": xs[n]}, return_numpy=False)["y"]
        assert executor.stats.last["path"] == "planned"
        # A copy exactly when the input is not the last call's: another row, or the same
        # row with the input somewhere else.
        assert len(stub.copies) == copies + (xs[n] is not previous)
        [region] = backend._regions  # pylint: disable=protected-access
        _, row = backend._groups[region].where[(n,)]  # pylint: disable=protected-access
        held = stub.copies[-1]  # what the device holds for this launch
        num_args = (len(held) - 16) // 8
        got_row, guards, *addresses = struct.unpack(f"<II8x{num_args}Q", held)
        assert (got_row, guards) == (row, 0)
        assert xs[n].data_ptr() in addresses and y.data_ptr() in addresses
        others = {t.data_ptr() for t in kept if t is not xs[n]}
        assert not others & set(addresses)  # no other input's address stayed
        previous = xs[n]
    assert stub.launches == len(steps)
