"""GPU tests: CPU-built artifacts run as CUDA graphs, checked against TVM's VM on the GPU.

Run on a GPU host with ``bash bench/gpu/run_all.sh`` (after ``make gpu-artifacts`` on the
build machine). They need only the TVM runtime, numpy, cuda-python, onnxruntime and pytest.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ARTIFACTS = Path(os.environ.get("GRAPE_GPU_ARTIFACTS", Path(__file__).parents[1] / "build" / "gpu"))


def _has_gpu() -> bool:
    try:
        from cuda.bindings import driver  # pylint: disable=import-outside-toplevel

        if driver.cuInit(0)[0] != driver.CUresult.CUDA_SUCCESS:
            return False
        err, count = driver.cuDeviceGetCount()
    except Exception:  # pylint: disable=broad-except
        return False  # no cuda-python, or no driver library on this machine
    return err == driver.CUresult.CUDA_SUCCESS and count > 0


if not _has_gpu():
    pytest.skip("no CUDA GPU here", allow_module_level=True)


def _artifact(name: str) -> Path:
    path = ARTIFACTS / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make gpu-artifacts` on the build machine")
    return path


@pytest.fixture(scope="module")
def blocks():
    """(grape executor, TVM VM on the same library, cuda device) for the bundled example."""
    from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel

    path = _artifact("blocks.cuda.grape")
    library, manifest, dev = load_library(path, "cuda")
    executor = load(path, "cuda")
    yield executor, VirtualMachine(library, dev), dev, manifest
    executor.close()


def _vm_reference(vm, dev, x):
    import tvm  # pylint: disable=import-outside-toplevel

    return vm["main"](tvm.runtime.tensor(x, dev)).numpy()


def test_every_shape_in_range_equals_tvm_vm(blocks):
    """One graph per topology: every shape first seen, then replayed, equals TVM's VM."""
    executor, vm, dev, manifest = blocks
    lo, hi = manifest["signature"]["dims"]["n"]
    rng = np.random.default_rng(0)
    order = rng.permutation(np.arange(lo, hi + 1))
    worst = 0.0
    for n in list(order) + list(rng.permutation(order)):  # first sight, then replay
        x = rng.standard_normal((int(n), 64)).astype(np.float32)
        got = executor.run({"x": x})["y"]
        want = _vm_reference(vm, dev, x)
        worst = max(worst, float(np.abs(got - want).max()))
    backend = executor.backend
    groups = backend.describe()["topology_groups"]["grape_region_0"]
    print(f"{len(order)} shapes twice, max |grape - TVM VM| = {worst:.3e}; {executor.stats}; "
          f"{len(groups)} topology group(s): {groups}")
    assert backend.mode == "topology", backend.fallback_reason
    assert worst <= 1e-5
    assert executor.stats.region_recordings == hi - lo + 1
    assert executor.stats.region_replays == hi - lo + 1
    assert backend.graphs_instantiated == len(groups) < (hi - lo + 1) // 4
    assert sum(g["shapes"] for g in groups) == hi - lo + 1


def test_a_topology_graph_makes_only_the_nodes_it_patches_device_updatable():
    """A device-updatable kernel node costs the GPU more a launch (bench/README.md), so a
    topology graph makes only the nodes its patch kernel updates so. One shape with its
    input at one device address: fewer than all; the input at other addresses, then other
    shapes of the group (columns): nodes join, the graph is instantiated again, and every
    result still equals TVM's VM."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel

    path = _artifact("blocks.cuda.grape")
    library, _, dev = load_library(path, "cuda")
    vm = VirtualMachine(library, dev)
    executor = load(path, "cuda")
    rng = np.random.default_rng(11)

    def group_of(n):
        groups = executor.backend.describe()["topology_groups"]["grape_region_0"]
        return next(g for g in groups if [n] in [list(k) for k in g["shape_keys"]])

    def check(x):
        want = _vm_reference(vm, dev, x.numpy())
        np.testing.assert_allclose(executor.run({"x": x})["y"], want, rtol=1e-5, atol=1e-5)

    try:
        inputs = [tvm.runtime.tensor(rng.standard_normal((3, 64)).astype(np.float32), dev)
                  for _ in range(3)]
        for _ in range(3):
            check(inputs[0])
        still = group_of(3)
        print(f"one shape, one input address: {still}")
        assert still["device_updatable_nodes"] < still["nodes"]
        for x in inputs[1:] + inputs[:1]:  # the input moves: its readers join
            check(x)
        for n in (4, 3, 4):  # the group's second shape: columns, their nodes join
            check(tvm.runtime.tensor(rng.standard_normal((n, 64)).astype(np.float32), dev))
        joined = group_of(3)
        print(f"after moves and a second shape: {joined}")
        assert joined["device_updatable_nodes"] > still["device_updatable_nodes"]
    finally:
        executor.close()


def test_per_shape_graphs_with_an_lru_bound_equal_tvm_vm():
    from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel
    from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

    path = _artifact("blocks.cuda.grape")
    library, _, dev = load_library(path, "cuda")
    vm = VirtualMachine(library, dev)
    executor = load(path, "cuda", graph_mode="per-shape", max_graphs=8)
    try:
        rng = np.random.default_rng(5)
        for n in rng.integers(1, 257, size=60):
            x = rng.standard_normal((int(n), 64)).astype(np.float32)
            np.testing.assert_allclose(executor.run({"x": x})["y"], _vm_reference(vm, dev, x),
                                       rtol=1e-5, atol=1e-5)
        d = executor.backend.describe()
        assert d["per_shape_graphs"] == 8 and d["evicted"] > 0
    finally:
        executor.close()


def test_record_all_then_every_call_replays():
    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    executor = load(_artifact("blocks.cuda.grape"), "cuda")
    try:
        seconds = executor.record_all()
        assert executor.stats.region_recordings == 256
        rng = np.random.default_rng(6)
        for n in rng.integers(1, 257, size=50):
            executor.run({"x": rng.standard_normal((int(n), 64)).astype(np.float32)})
        assert executor.stats.region_recordings == 256
        assert executor.stats.region_replays == 50
        print(f"recorded 256 shapes in {seconds:.2f} s; {executor.backend.describe()['graphs_instantiated']} graph(s)")
    finally:
        executor.close()


def test_shapes_beyond_max_shapes_reuse_table_rows_and_equal_tvm_vm():
    """At most ``max_shapes`` shapes held: the least recently used gives its argument-table
    row up, the next shape is written there on the device (the patch kernel forgets the
    row it applied last), and an evicted shape is recorded again when it comes back."""
    from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel

    path = _artifact("blocks.cuda.grape")
    library, _, dev = load_library(path, "cuda")
    vm = VirtualMachine(library, dev)
    executor = load(path, "cuda", max_shapes=6)
    try:
        rng = np.random.default_rng(8)
        sizes = [int(n) for n in rng.integers(1, 257, size=12)]
        for n in [sizes[i % len(sizes)] for i in range(40)] + sizes[::-1]:
            x = rng.standard_normal((n, 64)).astype(np.float32)
            np.testing.assert_allclose(executor.run({"x": x})["y"], _vm_reference(vm, dev, x),
                                       rtol=1e-5, atol=1e-5)
            assert executor.stats.plans_held <= 6 and executor.stats.shapes_held <= 6
        assert executor.backend.evicted > 0 and executor.stats.planned_calls > 0
        print(f"max_shapes=6: {executor.stats}")
    finally:
        executor.close()


def test_one_tensor_for_several_inputs_does_not_poison_a_shape():
    """Self-attention called with q = k = v (one device tensor) first: later calls at those
    dims with separate tensors read each of them; equal to TVM's VM every time."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel

    path = _artifact("attention.cuda.grape")
    library, _, dev = load_library(path, "cuda")
    vm = VirtualMachine(library, dev)
    executor = load(path, "cuda")
    rng = np.random.default_rng(9)

    def check(q, k, v):
        got = executor.run({"q": q, "k": k, "v": v})
        want = vm["main"](*[t if isinstance(t, tvm.runtime.Tensor) else tvm.runtime.tensor(t, dev)
                            for t in (q, k, v)])
        for name, value in zip(("y", "z"), want):
            np.testing.assert_allclose(got[name], value.numpy(), rtol=1e-5, atol=1e-5)

    try:
        for n in (5, 9, 5):
            one = tvm.runtime.tensor(rng.standard_normal((n, 16)).astype(np.float32), dev)
            check(one, one, one)
            for _ in range(3):
                check(*(rng.standard_normal((n, 16)).astype(np.float32) for _ in range(3)))
        assert executor.stats.unrecorded_calls >= 2 and executor.stats.planned_calls > 0
    finally:
        executor.close()


def test_a_dropped_executor_frees_its_graphs():
    """No cycle through TVM's FFI keeps an executor alive: dropped, it is collected and its
    graphs, tables and streams are freed."""
    import gc  # pylint: disable=import-outside-toplevel
    import weakref  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    def run_and_drop():
        executor = load(_artifact("blocks.cuda.grape"), "cuda")
        for n in (3, 70, 3):
            executor.run({"x": np.ones((n, 64), np.float32)})
        return weakref.ref(executor), weakref.ref(executor.backend)

    executor, backend = run_and_drop()
    gc.collect()
    assert executor() is None and backend() is None


def test_replays_in_random_order_with_new_inputs(blocks):
    executor, vm, dev, _ = blocks
    rng = np.random.default_rng(1)
    before = executor.stats.region_replays
    for n in rng.integers(1, 257, size=200):
        x = rng.standard_normal((int(n), 64)).astype(np.float32)
        np.testing.assert_allclose(executor.run({"x": x})["y"], _vm_reference(vm, dev, x),
                                   rtol=1e-5, atol=1e-5)
    assert executor.stats.region_replays - before == 200  # every shape was recorded before


def test_matches_onnxruntime(blocks):
    ort = pytest.importorskip("onnxruntime")
    import sys  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from blocks import make_blocks  # pylint: disable=import-outside-toplevel

    executor = blocks[0]
    session = ort.InferenceSession(make_blocks().SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    for n in (1, 2, 128, 255, 256):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        np.testing.assert_allclose(executor.run({"x": x})["y"], session.run(None, {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)


def test_device_inputs_at_new_addresses_are_repointed(blocks):
    """A replay reads the call's own input, wherever it lives (graph parameters repointed)."""
    import tvm  # pylint: disable=import-outside-toplevel

    executor, vm, dev, _ = blocks
    rng = np.random.default_rng(3)
    keep = []  # keep old inputs alive so that new ones get new addresses
    for _ in range(4):
        x = rng.standard_normal((33, 64)).astype(np.float32)
        xd = tvm.runtime.tensor(x, dev)
        keep.append(xd)
        got = executor.run({"x": xd})["y"]
        np.testing.assert_allclose(got, _vm_reference(vm, dev, x), rtol=1e-5, atol=1e-5)


def test_calls_queued_with_no_sync_each_read_their_own_launch_record(blocks):
    """Calls queued with no sync between them, each at its own shape, input and ``out=``
    buffer: every launch reads its own launch record (row and addresses), and every
    output equals TVM's VM."""
    import tvm  # pylint: disable=import-outside-toplevel

    executor, vm, dev, _ = blocks
    rng = np.random.default_rng(11)
    sizes = [int(n) for n in rng.choice([1, 7, 64, 200, 256], size=200)]
    for n in set(sizes):  # recorded first: the queued calls below are replays only
        executor.run({"x": np.zeros((n, 64), np.float32)})
    xs = [rng.standard_normal((n, 64)).astype(np.float32) for n in sizes]
    inputs = [tvm.runtime.tensor(x, dev) for x in xs]
    outs = [tvm.runtime.empty((n, 64), "float32", dev) for n in sizes]
    executor.backend.synchronize()
    before = executor.stats.region_replays
    for x, y in zip(inputs, outs):
        executor.run({"x": x}, return_numpy=False, out={"y": y})
    executor.backend.synchronize()
    assert executor.stats.region_replays - before == len(sizes)
    for x, y in zip(xs, outs):
        np.testing.assert_allclose(y.numpy(), _vm_reference(vm, dev, x), rtol=1e-5, atol=1e-5)


def test_calls_repeating_their_inputs_are_made_again_from_their_launch_records(blocks):
    """Input sets passed again (device tensors) are made again from the launch record
    their replay left, kept on the device (``stats.ready_calls``): the patch node is
    pointed at it, from the host. Two sets share a shape that is not the one its
    topology's graph was captured at, so that switching between them leaves the row's
    device-side updates as they are: they must survive the host's update of the patch
    node. Interleaved with calls on new tensors, whose records the executor writes, and
    queued with no sync, every output equals TVM's VM."""
    import tvm  # pylint: disable=import-outside-toplevel

    executor, vm, dev, _ = blocks
    rng = np.random.default_rng(12)
    for n in range(1, 81):  # recorded first, in order: n = 50 is not its topology's first
        executor.run({"x": np.zeros((n, 64), np.float32)})
    xs = [rng.standard_normal((n, 64)).astype(np.float32) for n in (50, 50, 7, 200)]
    tensors = [tvm.runtime.tensor(x, dev) for x in xs]
    executor.run({"x": np.zeros((200, 64), np.float32)})
    executor.backend.synchronize()
    before = executor.stats.ready_calls
    taken, kept = [], []
    for pick in rng.integers(0, len(xs) + 1, size=120):
        if pick == len(xs):  # a new tensor: its record written by the executor
            x = rng.standard_normal((50, 64)).astype(np.float32)
            tensor = tvm.runtime.tensor(x, dev)
        else:
            x, tensor = xs[pick], tensors[pick]
        y = executor.run({"x": tensor}, return_numpy=False)["y"]
        copy = tvm.runtime.empty(y.shape, "float32", dev)
        copy.copyfrom(y)  # ordered after the call: the backend's stream is a blocking one
        taken.append(x)
        kept.append(copy)
    executor.backend.synchronize()
    assert executor.stats.ready_calls - before > 60
    for x, y in zip(taken, kept):
        np.testing.assert_allclose(y.numpy(), _vm_reference(vm, dev, x), rtol=1e-5, atol=1e-5)


def test_torch_views_are_read_in_place_and_strided_ones_refused(blocks):
    """DLPack from torch: a view at an offset into a larger tensor is read where it is (no
    copy counted), and equals the VM; a transposed view gets one clear error."""
    torch = pytest.importorskip("torch")
    from grape_tvm.runtime.signature import InputError  # pylint: disable=import-outside-toplevel

    executor, vm, dev, _ = blocks
    big = torch.randn(300, 64, device="cuda")
    for start, n in ((5, 40), (17, 1), (100, 200)):
        view = big[start:start + n]  # contiguous, at an offset into big's storage
        got = executor.run({"x": view})["y"]
        assert executor.stats.last["h2d_bytes"] == 0 and executor.stats.last["d2d_bytes"] == 0
        np.testing.assert_allclose(got, _vm_reference(vm, dev, view.cpu().numpy()),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises((InputError, ValueError), match="not contiguous"):
        executor.run({"x": torch.randn(64, 30, device="cuda").t()})


def test_first_launch_after_instantiation_is_fresh(blocks):
    """Each new shape is captured, instantiated, uploaded and launched at once: check it."""
    executor, vm, dev, manifest = blocks
    # A fresh executor: every call below is a first launch after instantiation.
    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    fresh = load(_artifact("blocks.cuda.grape"), "cuda")
    try:
        rng = np.random.default_rng(4)
        for n in (5, 200, 6, 199):
            x = rng.standard_normal((n, 64)).astype(np.float32)
            np.testing.assert_allclose(fresh.run({"x": x})["y"], _vm_reference(vm, dev, x),
                                       rtol=1e-5, atol=1e-5)
        assert fresh.stats.region_recordings == 4
    finally:
        fresh.close()


def test_bad_inputs_fail_before_any_kernel(blocks):
    from grape_tvm.runtime.signature import InputError  # pylint: disable=import-outside-toplevel

    executor = blocks[0]
    calls = executor.stats.calls
    with pytest.raises(InputError, match="outside its declared range 1..256"):
        executor.run({"x": np.zeros((257, 64), np.float32)})
    with pytest.raises(InputError, match="dtype float64, expected float32"):
        executor.run({"x": np.zeros((4, 64), np.float64)})
    with pytest.raises(InputError, match="missing input"):
        executor.run({})
    assert executor.stats.calls == calls
    x = np.ones((4, 64), np.float32)
    assert executor.run({"x": x})["y"].shape == (4, 64)  # still usable


def test_cuda_artifact_built_on_cpu_carries_cubins(blocks):
    manifest = blocks[3]
    assert manifest["target"] == {"kind": "cuda", "arch": "sm_90"}
    assert len(manifest["cubins"]) >= 2  # the model's kernels and the patch kernel


def test_decode_loop_feeds_its_cache_back_with_no_copies():
    """A GPT-2-style decode step (2 layers, KV cache growing one row per call): each call's
    cache outputs are the next call's inputs, read in place; equal to TVM's VM at every step."""
    import sys  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import gpt2_weights  # pylint: disable=import-outside-toplevel

    path = _artifact("gpt2_tiny.cuda.grape")
    library, _, dev = load_library(path, "cuda")
    vm = VirtualMachine(library, dev)
    executor = load(path, "cuda")
    weights = {k: tvm.runtime.tensor(v, dev) for k, v in gpt2_weights(64, 2).items()}
    executor.bind_inputs(weights)
    names = [f"past_{kv}{i}" for i in range(2) for kv in ("k", "v")]
    rng = np.random.default_rng(7)
    start = {n: tvm.runtime.tensor((0.1 * rng.standard_normal((4, 1, 16))).astype(np.float32), dev)
             for n in names}
    xs = [tvm.runtime.tensor(rng.standard_normal((1, 64)).astype(np.float32), dev) for _ in range(64)]
    try:
        for loop in range(2):  # the first records every length, the second is planned
            past = dict(start)
            for length in range(1, 64):
                out = executor.run({"x": xs[length], **past}, return_numpy=False)
                last = executor.stats.last
                assert last["h2d_bytes"] == last["d2d_bytes"] == last["d2h_bytes"] == 0
                if loop == 1:
                    assert last["path"] == "planned" and last["graph_launches"] == 1
                want = vm["main"](xs[length], *[past[n] for n in names], *weights.values())
                np.testing.assert_allclose(out["y"].numpy(), want[0].numpy(), rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(out["present_v1"].numpy(), want[4].numpy(), rtol=1e-5, atol=1e-5)
                past = {n: out["present_" + n[len("past_"):]] for n in names}
        assert executor.backend.graphs_instantiated == len(
            executor.backend.describe()["topology_groups"]["grape_region_0"])
    finally:
        executor.close()


# -- a whole decode loop as one graph launch (compile_loop / load_loop) -----------------

@pytest.fixture(scope="module")
def decoder():
    """(config, weights, TVM's VM on its own build of the step, cuda device)."""
    import sys  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load_library  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import DECODER_TINY, decoder_weights  # pylint: disable=import-outside-toplevel

    config = DECODER_TINY
    weights = decoder_weights(config["vocab"], config["hidden"], config["layers"],
                              config["max_len"], seed=3)
    library, _, dev = load_library(_artifact("decoder_tiny.tvm_vm.cuda.grape"), "cuda")
    del tvm
    return config, weights, VirtualMachine(library, dev), dev


def _initial(config, batch):
    from models import decoder_initial_state  # pylint: disable=import-outside-toplevel

    return decoder_initial_state(batch, config["heads"], config["hidden"] // config["heads"],
                                 config["layers"], config["max_len"])


def _vm_decode(decoder, batch, eos):
    import tvm  # pylint: disable=import-outside-toplevel
    from models import decoder_state_names  # pylint: disable=import-outside-toplevel

    config, weights, vm, dev = decoder
    carried = decoder_state_names(config["layers"])
    state = {k: tvm.runtime.tensor(v, dev) for k, v in _initial(config, batch).items()}
    fixed = [tvm.runtime.tensor(np.array([eos], np.int32), dev)]
    fixed += [tvm.runtime.tensor(w, dev) for w in weights.values()]
    steps = 0
    while steps < config["max_len"] - 1:
        out = vm["main"](*[state[n] for n in carried], *fixed)
        steps += 1
        state = dict(zip(carried, out[:len(carried)]))
        if out[len(carried)].numpy().any():
            break
    return state["tokens"].numpy(), steps


def test_device_loop_generates_the_vm_tokens_in_one_launch(decoder):
    """WHILE-node loop, host-driven grape loop and TVM's VM: same tokens, same stop step,
    for a loop stopped by EOS and one stopped by the step limit, batch 1 and 3."""
    import grape_tvm  # pylint: disable=import-outside-toplevel

    config, weights, _, _ = decoder
    path = _artifact("decoder_tiny.loop.cuda.grape")
    free, _ = _vm_decode(decoder, 1, eos=config["vocab"] + 1)
    for batch in (1, 3):
        for eos in (config["vocab"] + 1, int(free[0, 5])):
            want, want_steps = _vm_decode(decoder, batch, eos)
            results = {}
            for mode in ("device", "host"):
                with grape_tvm.load_loop(path, "cuda", mode=mode) as loop:
                    loop.bind_inputs({"eos": np.array([eos], np.int32), **weights})
                    first = loop.run(_initial(config, batch))
                    again = loop.run(_initial(config, batch))  # the same graph, relaunched
                    results[mode] = (first.steps, first.state["tokens"].numpy(), again.steps,
                                     again.state["tokens"].numpy())
                    if mode == "device":
                        assert loop.runner.launches == 2 and len(loop.runner._graphs) == 1
            for mode, (steps, tokens, steps2, tokens2) in results.items():
                assert steps == steps2 == want_steps, (mode, batch, eos)
                np.testing.assert_array_equal(tokens, want, err_msg=f"{mode} batch {batch}")
                np.testing.assert_array_equal(tokens2, want)
            if eos <= config["vocab"] and batch == 1:
                assert want_steps <= 5  # stopped by EOS, early


def test_device_loop_follows_rebound_invariants(decoder):
    """Binding a new EOS after the loop graph was built: the next run must read it (the
    graph is rebuilt), not the value captured before."""
    import grape_tvm  # pylint: disable=import-outside-toplevel

    config, weights, _, _ = decoder
    free, _ = _vm_decode(decoder, 1, eos=config["vocab"] + 1)
    with grape_tvm.load_loop(_artifact("decoder_tiny.loop.cuda.grape"), "cuda") as loop:
        loop.bind_inputs({"eos": np.array([config["vocab"] + 1], np.int32), **weights})
        assert loop.run(_initial(config, 1)).steps == config["max_len"] - 1
        eos = int(free[0, 5])
        loop.bind_inputs({"eos": np.array([eos], np.int32)})
        want, want_steps = _vm_decode(decoder, 1, eos)
        got = loop.run(_initial(config, 1))
        assert got.steps == want_steps <= 5
        np.testing.assert_array_equal(got.state["tokens"].numpy(), want)


def test_onnx_loop_runs_on_the_device_like_onnxruntime():
    """An ONNX Loop (stop on the data, or on the trip count M) as one device loop: outputs
    and step counts equal onnxruntime's, one launch per run."""
    import grape_tvm  # pylint: disable=import-outside-toplevel
    from conftest import onnxruntime_outputs  # pylint: disable=import-outside-toplevel
    from conftest import affine_loop_inputs as _affine_inputs  # pylint: disable=import-outside-toplevel
    from conftest import affine_loop_steps as _ort_steps  # pylint: disable=import-outside-toplevel

    onnx_path = _artifact("affine_loop.onnx")
    with grape_tvm.load_onnx_loop(_artifact("affine_loop.cuda.grape"), "cuda") as loop:
        assert loop.mode == "device"
        for n in (1, 7, 64):
            inputs = _affine_inputs(n, 10_000)
            free = _ort_steps(inputs["x"], inputs["b"], 10_000)
            for trip in (10_000, max(free - 1, 1)):
                inputs["M"] = np.array(trip, np.int64)
                got = loop.run(inputs)
                want = onnxruntime_outputs(onnx_path, inputs)
                np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-5)
                assert loop.steps == min(free, trip) and loop.launches == 1


def _branch_model(mode: str):
    """``models.branch_model`` (width 512), its weights bound: (grape executor in graph
    ``mode``, TVM's VM on the same library, the weights on the device in the VM's order,
    the device)."""
    import sys  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import BRANCH_WEIGHTS, branch_weights  # pylint: disable=import-outside-toplevel

    path = _artifact("branches.grape.cuda.grape")
    library, _, dev = load_library(path, "cuda")
    executor = load(path, "cuda", graph_mode=mode)
    weights = branch_weights(512)
    executor.bind_inputs(weights)
    on_device = [tvm.runtime.tensor(weights[k], dev) for k in BRANCH_WEIGHTS]
    return executor, VirtualMachine(library, dev), on_device, dev


@pytest.mark.parametrize("mode", ["topology", "per-shape"])
def test_conditional_region_equals_the_vm_without_reading_the_condition(mode):
    """``models.branch_model``: both branches' graphs launch on every planned call, the one
    not taken disabled by its patch kernel (topology mode: no host read at all; per-shape
    mode reads each guard on the host). If both ran, the else branch, launched last, would
    overwrite the then branch's result: equality with the VM (one branch) shows they don't."""
    import tvm  # pylint: disable=import-outside-toplevel

    executor, vm, on_device, dev = _branch_model(mode)
    rng = np.random.default_rng(5)
    worst, taken = 0.0, []
    for n in (1, 7, 300, 7, 1, 300, 1024):
        x = rng.standard_normal((n, 512)).astype(np.float32)
        for threshold in (-10.0, 10.0, -10.0):
            thr = np.array(threshold, np.float32)
            got = executor.run({"x": x, "threshold": thr})["y"]
            want = vm["main"](tvm.runtime.tensor(x, dev), *on_device,
                              tvm.runtime.tensor(thr, dev)).numpy()
            worst = max(worst, float(np.abs(got - want).max()))
            taken.append(executor.stats.last["path"])
    described = executor.backend.describe()
    print(f"{mode}: max |grape - VM| = {worst:.3e}; paths {taken}; "
          f"host-read guards {described['synchronizing_guards']}; {executor.stats}")
    assert worst <= 1e-4
    assert taken == ["planned"] * len(taken)  # every call from the call program, no VM
    if mode == "topology":
        assert described["synchronizing_guards"] == 0
    else:
        assert described["synchronizing_guards"] > 0
    executor.close()


def test_conditional_regions_made_again_with_their_inputs_equal_the_vm():
    """Input sets of the branch model (device tensors, both branches taken) passed again
    in turn: calls made again (``stats.ready_calls``) launch their guarded regions from
    their argument lists, the patch kernel reading each guard (a guarded launch keeps no
    ready record), and equal the VM."""
    import tvm  # pylint: disable=import-outside-toplevel

    executor, vm, on_device, dev = _branch_model("topology")
    rng = np.random.default_rng(13)
    sets = [{"x": tvm.runtime.tensor(rng.standard_normal((n, 512)).astype(np.float32), dev),
             "threshold": tvm.runtime.tensor(np.array(threshold, np.float32), dev)}
            for n in (7, 300) for threshold in (-10.0, 10.0)]
    wants = [vm["main"](s["x"], *on_device, s["threshold"]).numpy() for s in sets]
    for pick in rng.integers(0, len(sets), size=40):
        got = executor.run(sets[pick])["y"]
        np.testing.assert_allclose(got, wants[pick], rtol=1e-4, atol=1e-4)
    assert executor.stats.ready_calls > 20
    executor.close()


def test_nested_conditional_regions_equal_the_vm():
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load, load_library  # pylint: disable=import-outside-toplevel

    path = _artifact("nested.cuda.grape")
    library, manifest, dev = load_library(path, "cuda")
    assert len(manifest["plan"]["conditionals"]) == 2
    executor = load(path, "cuda")
    vm = VirtualMachine(library, dev)
    rng = np.random.default_rng(6)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    for n in (3, 20):
        x = rng.standard_normal((n, 16)).astype(np.float32)
        for c1, c2 in [(True, True), (True, False), (False, True), (False, False), (True, True)]:
            inputs = {"x": x, "w": w, "c1": np.array(c1), "c2": np.array(c2)}
            got = executor.run(inputs)["y"]
            want = vm["main"](*[tvm.runtime.tensor(v, dev) for v in inputs.values()]).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert executor.stats.last["path"] == "planned"
    executor.close()


# -- reductions over a symbolic dim (grape's FullReduction, dlight's Reduction) -----------

@pytest.fixture(scope="module")
def reductions():
    """(grape executor, ``models.reductions_numpy``) for ``reductions.cuda.grape``."""
    import sys  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import reductions_numpy  # pylint: disable=import-outside-toplevel

    executor = load(_artifact("reductions.cuda.grape"), "cuda")
    yield executor, reductions_numpy
    executor.close()


def _check_reductions(executor, reference, x: np.ndarray, threshold: float) -> None:
    got = executor.run({"x": x, "threshold": np.array(threshold, np.float32)})
    want = reference(x, threshold)
    # float32 sums of up to 512 Ki values against float64: a tolerance scaled by the sum of
    # the magnitudes (one value missed or counted twice is far outside it).
    scale = {"mean": np.abs(x).sum() / max(x.size, 1), "sum_rows": np.abs(x).sum(0, keepdims=True),
             "sum_all": np.abs(x).sum(keepdims=True)}
    for name, value in want.items():
        assert got[name].shape == value.shape, name
        if name in scale:
            assert np.all(np.abs(got[name] - value) <= 1e-6 * scale[name] + 1e-7), name
        else:  # max, min and the comparison are exact
            np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("n", [1, 2, 7, 300, 1023, 1024])
def test_reductions_over_n_rows_equal_numpy(reductions, n):
    """Means, sums, max and min of (n, 512), n up to the range's end; the comparison with
    the mean a quarter above and below it (``branch_model``'s condition, both ways)."""
    executor, reference = reductions
    x = np.random.default_rng(n).standard_normal((n, 512)).astype(np.float32)
    mean = float(x.astype(np.float64).mean())
    for threshold in (mean - 0.25, mean + 0.25):
        _check_reductions(executor, reference, x, threshold)


def test_empty_reductions_give_the_identity(reductions):
    """n = 0 between calls with rows: 0 for the sums and the mean, -inf for the max, +inf
    for the min (each kernel's accumulators start at the identity), not a value left in
    the outputs' buffers."""
    executor, reference = reductions
    rng = np.random.default_rng(11)
    for n in (1024, 0, 5, 0):
        x = rng.standard_normal((n, 512)).astype(np.float32)
        for threshold in (-1.0, 1.0):
            _check_reductions(executor, reference, x, threshold)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cublaslt_matmuls_in_graphs_equal_numpy(dtype):
    """A GPT-2 MLP whose matmuls are cuBLASLt calls captured into the region's graph (bias
    and tanh-GELU in cuBLASLt's epilogue, a weight stored [N, K]): every n first seen, then
    replayed at new input addresses, equals numpy; the kernels are re-pointed and re-shaped
    by the patch kernel (fp16's cuBLAS kernels take their parameters through ``extra``).
    No kernel node runs in thread-block clusters: a device-side update slows a clustered
    node on every later launch (runtime/cublaslt.py; fp16 chose clustered kernels before)."""
    sizes = [1, 2, 3, 7, 8, 9, 64, 300, 1024]
    with _library_executor(dtype) as run:
        worst, executor = run(sizes, rounds=2)
        backend = executor.backend.describe()
        print(f"{dtype}: worst relative error {worst:.2e}; {executor.stats}; algorithms "
              f"{backend['cublaslt_algorithms']}")
        # Every call runs from the call program; the second round replays every n.
        assert executor.stats.planned_calls == 2 * len(sizes)
        assert executor.stats.region_replays >= len(sizes)
        assert backend["mode"] == "topology"
        assert backend["cluster_kernel_nodes"] == 0, backend["cublaslt_algorithms"]


@pytest.mark.timeout(300, method="thread")
def test_outputs_of_odd_width_run_split_and_equal_numpy():
    """fp16 outputs of 50257 and 4099 columns from weights stored [N, K] (GPT-2's LM head,
    a narrower one with a bias): cuBLASLt runs the first N // 8 * 8 columns into its
    scratch buffer, copied into place, a chunk of 256 rows at a time for 50257, and the
    last 64 columns straight into the output. Every n of one to four chunks, on both sides
    of the first two boundaries (256, 512), first seen and replayed at new addresses in a
    random order, equals numpy; the split's algorithms are the ones ``inspect`` reports."""
    import sys  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import wide_head_numpy, wide_head_weights  # pylint: disable=import-outside-toplevel

    executor = load(_artifact("wide_head_float16.cuda.grape"), "cuda")
    weights = wide_head_weights("float16")
    executor.bind_inputs({k: tvm.runtime.tensor(v, executor.device) for k, v in weights.items()})
    rng = np.random.default_rng(12)
    sizes = [1, 3, 9, 255, 256, 257, 300, 512, 513, 1024]
    try:
        # n = 1 first seen, then replayed after another n: its last columns came out wrong
        # when cuBLASLt ran them as a 1 x 1 product (runtime/cublaslt.py, TAIL_COLUMNS)
        for n in [1, 3, 1] + [int(n) for _ in range(2) for n in rng.permutation(sizes)]:
            x = rng.standard_normal((n, 64)).astype(np.float16)
            got = executor.run({"x": x})
            for name, want in zip(("y", "z"), wide_head_numpy(x, weights)):
                error = float(np.abs(got[name].astype(np.float64) - want).max() /
                              np.abs(want).max())
                assert error <= 2e-2, (n, name, error)
        chosen = executor.backend.describe()["cublaslt_algorithms"]
        groups = executor.backend.describe()["topology_groups"]
        print(f"algorithms {sorted(chosen)}; topologies "
              f"{sum(len(g) for g in groups.values())}; {executor.stats}")
        assert executor.stats.planned_calls == 2 * len(sizes) + 3
        # the aligned part (chunks of 256 rows past 256) and the tails, 50257's and 4099's
        assert any("N=50256" in key and "M<=256" in key for key in chosen), chosen
        assert any("N=64/ld=50257" in key for key in chosen), chosen
        assert any("N=64/ld=4099" in key for key in chosen), chosen
    finally:
        executor.close()


@pytest.mark.timeout(120, method="thread")
def test_split_k_counters_are_zeroed_for_every_m_of_a_topology():
    """For M in 129..256 cuBLASLt's fp32 split-K zeroes counters in its workspace with a
    memset whose address and size follow M. A graph captured at one M and replayed at
    another whose memset differed hung the H200 (the counters of the new M were never
    zeroed: bench/results/gpu_run/cublaslt_memset_hang.log). Topology graphs run the
    memsets as grape_fill kernels, patched per shape like any kernel: each n equals numpy,
    in any order, first seen and replayed, with no memset node left in any graph."""
    sizes = [129, 136, 190, 199, 250, 256]
    with _library_executor("float32") as run:
        worst, executor = run(sizes, rounds=2)
        described = executor.backend.describe()
        topologies = sum(len(region) for region in described["topology_groups"].values())
        print(f"worst relative error {worst:.2e}; {described['memsets_as_kernels']} memsets "
              f"run as kernels; topologies {topologies} for {len(sizes)} sizes; "
              f"{executor.stats}")
        assert executor.stats.planned_calls == 2 * len(sizes)
        assert described["memsets_as_kernels"] > 0, \
            "no memset captured: the test no longer covers what it is for"
        # One algorithm over the bucket; its memsets no longer split it (2 topologies when
        # they were memset nodes, on the H200).
        assert topologies == 1


@pytest.mark.timeout(180, method="thread")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cublaslt_attention_products_equal_numpy(dtype):
    """A decode step's attention, ``softmax(q @ k^T / sqrt(d)) @ v`` at a head_dim no attention
    kernel of grape's takes (``UNFUSED_HEAD_DIM``), at pasts p from 1 to 1024 and batches 1
    and 3: both products are strided-batched cuBLASLt calls in the region's graph (k's
    transpose read in place), an algorithm per bucket of the sizes. Every (b, p), first seen
    and replayed at new addresses in a random order, equals numpy."""
    import sys  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import UNFUSED_HEAD_DIM, attention_numpy  # pylint: disable=import-outside-toplevel

    executor = load(_artifact(f"attention_products_{dtype}.cuda.grape"), "cuda")
    d = UNFUSED_HEAD_DIM
    rng = np.random.default_rng(3)
    shapes = [(b, p) for b in (1, 3) for p in (1, 2, 7, 64, 65, 300, 1024)]
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    worst = 0.0
    try:
        for index in [int(i) for _ in range(2) for i in rng.permutation(len(shapes))]:
            b, p = shapes[index]
            q, k, v = (rng.standard_normal(shape).astype(dtype)
                       for shape in ((b, 12, 1, d), (b, 12, p, d), (b, 12, p, d)))
            got = executor.run({"q": q, "k": k, "v": v})["o"].astype(np.float64)
            want = attention_numpy(q, k, v)
            error = float(np.abs(got - want).max() / np.abs(want).max())
            worst = max(worst, error)
            assert error <= tolerance, (dtype, b, p, error)
        groups = executor.backend.describe()["topology_groups"]
        print(f"{dtype}: worst relative error {worst:.2e}; topologies "
              f"{ {r: len(g) for r, g in groups.items()} }; {executor.stats}")
        assert executor.stats.planned_calls == 2 * len(shapes)  # every call, from the program
    finally:
        executor.close()


@pytest.mark.timeout(180, method="thread")
@pytest.mark.parametrize("name", [f"decode_attention_{dtype}_d{head_dim}"
                                  for dtype in ("float32", "float16") for head_dim in (64, 128)])
def test_decode_attention_equals_numpy(name):
    """A decode step's attention, ``softmax(q @ k^T / sqrt(d) + mask) @ v`` with one query
    row, on grape's decode attention kernel (``passes.FuseAttention``), at pasts p from 1 to
    1024 (inside, at and past a warp's 32 keys and a block's 256) and batches 1, 3 and 8
    (12, 36 and 96 rows: split or not), a mask input with some keys at the dtype's lowest
    value, first seen and replayed at new addresses in a random order: every output equals
    numpy's float64."""
    import sys  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import attention_numpy  # pylint: disable=import-outside-toplevel

    executor = load(_artifact(f"{name}.cuda.grape"), "cuda")
    kernels = {k for r in executor.manifest["plan"]["regions"] for k in r["kernels"]}
    assert "grape.decode_attention.fused_bias" in kernels, kernels
    dtype, head_dim = name.split("_")[2], int(name.split("_d")[-1])
    rng = np.random.default_rng(7)
    shapes = [(b, p) for b in (1, 3, 8) for p in (1, 2, 31, 33, 255, 256, 257, 1024)]
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    worst = 0.0
    try:
        for index in [int(i) for _ in range(2) for i in rng.permutation(len(shapes))]:
            b, p = shapes[index]
            q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in
                       ((b, 12, 1, head_dim), (b, 12, p, head_dim), (b, 12, p, head_dim)))
            mask = (rng.standard_normal((b, 1, 1, p)) * 2).astype(dtype)
            mask[..., 1::3] = np.finfo(dtype).min
            got = executor.run({"q": q, "k": k, "v": v, "mask": mask})["o"].astype(np.float64)
            want = attention_numpy(q, k, v, mask)
            error = float(np.abs(got - want).max() / np.abs(want).max())
            worst = max(worst, error)
            assert error <= tolerance, (name, b, p, error)
        print(f"{name}: worst relative error {worst:.2e}; {executor.stats}")
        assert executor.stats.planned_calls == 2 * len(shapes)
    finally:
        executor.close()


@pytest.mark.timeout(180, method="thread")
@pytest.mark.parametrize("name", [f"cached_attention_{dtype}_d{head_dim}"
                                  for dtype in ("float32", "float16") for head_dim in (64, 128)])
def test_decode_attention_appending_to_the_cache_equals_numpy(name):
    """A decode step appending its keys and values to the cache (``models.cached_attention``,
    GPT-2's export): one call of the _append kernel writes the output and both present
    caches. Each batch of 1, 3 and 8 decodes from pasts of 1 and 254 for 40 and 6 steps
    (inside and past a warp's 32 keys and a block's 256), feeding the presents back as the
    next step's past (the executor's own tensors, no copy), and once from 1022 (1023 keys,
    split); all of it twice, the second time replaying the recordings of the first at new
    inputs: every output and every present equals numpy's."""
    import sys  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import cached_attention_numpy  # pylint: disable=import-outside-toplevel

    executor = load(_artifact(f"{name}.cuda.grape"), "cuda")
    kernels = {k for r in executor.manifest["plan"]["regions"] for k in r["kernels"]}
    assert kernels == {"grape.decode_attention.fused_bias_append"}, kernels
    dtype, head_dim = name.split("_")[2], int(name.split("_d")[-1])
    rng = np.random.default_rng(11)
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    worst, calls = 0.0, 0

    def step(qkv, past_k, past_v, host_k, host_v):
        nonlocal worst, calls
        b, p = host_k.shape[0], host_k.shape[2]
        mask = (rng.standard_normal((b, 1, 1, p + 1)) * 2).astype(dtype)
        mask[..., 1::3] = np.finfo(dtype).min
        got = executor.run({"qkv": qkv, "past_k": past_k, "past_v": past_v, "mask": mask},
                           return_numpy=False)
        calls += 1
        want = cached_attention_numpy(qkv.astype(np.float64), host_k, host_v, mask)
        o = got["o"].numpy().astype(np.float64)
        error = float(np.abs(o - want[0]).max() / np.abs(want[0]).max())
        worst = max(worst, error)
        assert error <= tolerance, (name, b, p, error)
        for key, expected in (("present_k", want[1]), ("present_v", want[2])):
            np.testing.assert_array_equal(got[key].numpy(), expected.astype(dtype))
        return got["present_k"], got["present_v"], want[1].astype(dtype), want[2].astype(dtype)

    try:
        for b in (1, 3, 8, 1, 3, 8):
            for first, steps in ((1, 40), (254, 6), (1022, 1)):
                host_k, host_v = (rng.standard_normal((b, 12, first, head_dim)).astype(dtype)
                                  for _ in range(2))
                past_k, past_v = host_k, host_v
                for _ in range(steps):
                    qkv = rng.standard_normal((b, 1, 3 * 12 * head_dim)).astype(dtype)
                    past_k, past_v, host_k, host_v = step(qkv, past_k, past_v, host_k, host_v)
        print(f"{name}: worst relative error {worst:.2e} over {calls} steps; {executor.stats}")
        assert executor.stats.planned_calls == calls
        assert executor.stats.region_replays == calls // 2  # the second round's
    finally:
        executor.close()


@pytest.mark.timeout(180, method="thread")
@pytest.mark.parametrize("name,heads", [("fused_attention_causal_d64", 12),
                                        ("fused_attention_bias_d64", 12),
                                        ("fused_attention_causal_d128", 4)])
def test_fused_attention_equals_numpy(name, heads):
    """GPT-2's prefill attention over a packed qkv (fp16) on grape's fused attention kernel
    (``passes.FuseAttention``: q, k and v read in place, the output written transposed; the
    causal mask as the kernel's causal mode, or a bias input read broadcast over heads), at
    sequences that end inside, at and past a 64-row block, batches 1 and 3, first seen and
    replayed at new addresses in a random order: every output equals numpy's float64."""
    import sys  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import causal_attention_numpy  # pylint: disable=import-outside-toplevel

    executor = load(_artifact(f"{name}.cuda.grape"), "cuda")
    assert "attention" in executor.manifest["plan"]["libraries"]
    rng = np.random.default_rng(5)
    shapes = [(b, s) for b in (1, 3) for s in (1, 5, 64, 65, 200, 1024)]
    width = 3 * heads * (128 if name.endswith("d128") else 64)
    worst = 0.0
    try:
        for index in [int(i) for _ in range(2) for i in rng.permutation(len(shapes))]:
            b, s = shapes[index]
            inputs = {"qkv": rng.standard_normal((b, s, width)).astype("float16")}
            bias = None
            if "bias" in name:
                bias = (rng.standard_normal((b, 1, s, s)) * 2).astype("float16")
                inputs["bias"] = bias
            got = executor.run(inputs)["y"].astype(np.float64)
            want = causal_attention_numpy(inputs["qkv"], heads, bias)
            error = float(np.abs(got - want).max())
            worst = max(worst, error)
            assert error <= 1e-2, (name, b, s, error)
        print(f"{name}: worst absolute error {worst:.2e}; {executor.stats}")
    finally:
        executor.close()


@pytest.mark.timeout(180, method="thread")
def test_fused_attention_of_dense_operands_equals_numpy():
    """Separate q, k and v read dense, the output left [b, h, s, d] and a (s, s) bias read
    with batch and head strides of 0 (``models.dense_attention``, fp16), at sequences inside,
    at and past a 64-row block, batches 1 and 2, in a random order: equal numpy's float64."""
    import sys  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import attention_numpy  # pylint: disable=import-outside-toplevel

    executor = load(_artifact("fused_attention_dense_d64.cuda.grape"), "cuda")
    assert "attention" in executor.manifest["plan"]["libraries"]
    rng = np.random.default_rng(6)
    shapes = [(b, s) for b in (1, 2) for s in (3, 64, 100, 513)]
    try:
        for index in [int(i) for _ in range(2) for i in rng.permutation(len(shapes))]:
            b, s = shapes[index]
            inputs = {n: rng.standard_normal((b, 12, s, 64)).astype("float16") for n in "qkv"}
            inputs["bias"] = rng.standard_normal((s, s)).astype("float16")
            got = executor.run(inputs)["y"].astype(np.float64)
            want = attention_numpy(inputs["q"], inputs["k"], inputs["v"], inputs["bias"])
            error = float(np.abs(got - want).max())
            assert error <= 1e-2, (b, s, error)
    finally:
        executor.close()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_few_rows_on_gemv_kernels_and_cublaslt_above_equal_numpy(dtype):
    """The same MLP built with the default ``matmul="auto"``: grape's GEMV kernels where the
    rows are few (``passes/few_rows_gemv.py``: n = 1 for the [K, N] weight, n <= 8 for the
    [N, K] one, epilogues fused), cuBLASLt called from the same kernel function above, both
    captured in the region's graph. Every n on both sides of each bucket, first seen and
    replayed in a random order at new input addresses, equals numpy, and cuBLASLt ran only
    the rows above each weight's GEMV buckets."""
    sizes = [1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 300, 1024]
    with _library_executor(dtype, "auto") as run:
        worst, executor = run(sizes, rounds=2)
        groups = executor.backend.describe()["topology_groups"]
        topologies = sum(len(region) for region in groups.values())
        chosen = executor.backend.describe()["cublaslt_algorithms"]
        print(f"{dtype}: worst relative error {worst:.2e}; topologies {topologies} for "
              f"{len(sizes)} sizes; {executor.stats}; cuBLASLt's buckets {sorted(chosen)}")
        assert executor.stats.planned_calls == 2 * len(sizes)
        assert executor.stats.region_replays >= len(sizes)

        def library_rows(function: str) -> set[int]:  # the buckets cuBLASLt ran
            return {int(key.split("/M<=")[1].split("/")[0]) for key in chosen
                    if key.startswith(f"grape.cublaslt.{function}/")}

        # [K, N]: n = 1 on the GEMV kernel; [N, K]: n <= 8; cuBLASLt above both
        assert min(library_rows("matmul_bias_gelu")) == 2
        assert min(library_rows("matmul_residual_nt")) == 16


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_an_erf_gelu_fused_on_gemv_kernels_and_after_cublaslt_equals_numpy(dtype):
    """``library_layer`` with an erf GELU, which cuBLASLt's epilogues lack: fused into the
    GEMV kernels' epilogue where the rows are few, a kernel of its own after cuBLASLt's
    above them, in one kernel function (``passes/few_rows_gemv.py``); no GELU kernel of its
    own in the plan. Every n on both sides of the buckets, first seen and replayed, equals
    numpy's erf GELU, and cuBLASLt ran the rows above the [K, N] weight's one."""
    sizes = [1, 2, 3, 8, 9, 17, 300, 1024]
    with _library_executor(dtype, "auto", gelu="erf") as run:
        worst, executor = run(sizes, rounds=2)
        kernels = [k for r in executor.manifest["plan"]["regions"] for k in r["kernels"]]
        chosen = executor.backend.describe()["cublaslt_algorithms"]
        print(f"{dtype}: worst relative error {worst:.2e}; kernels {kernels}")
        assert kernels == ["grape.cublaslt.matmul_bias", "grape.cublaslt.matmul_residual_nt"]
        assert any(key.startswith("grape.cublaslt.matmul_bias/") for key in chosen), chosen


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_layer_norms_computed_by_the_gemv_kernels_and_before_cublaslt_equal_numpy(dtype):
    """``library_layer`` with a layer norm before each matmul (and an erf GELU after the
    first): at one row the GEMV kernel normalizes its row itself, for more the norm's
    kernel writes its output and a GEMV kernel or cuBLASLt reads it, in one kernel function
    (``passes/few_rows_gemv.py``). No norm runs as a call of its own; every n on both sides
    of the buckets, first seen and replayed, equals numpy (float64)."""
    sizes = [1, 2, 3, 4, 5, 8, 9, 17, 300, 1024]
    with _library_executor(dtype, "auto", gelu="erf", norm=True) as run:
        worst, executor = run(sizes, rounds=2)
        calls = [k for r in executor.manifest["plan"]["regions"] for k in r["kernels"]]
        print(f"{dtype}: worst relative error {worst:.2e}; kernels {calls}")
        assert calls == ["grape.cublaslt.matmul_bias", "grape.cublaslt.matmul_residual_nt"]


@pytest.mark.timeout(240, method="thread")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_convs_as_windows_and_cublaslt_matmuls_equal_numpy(dtype):
    """``models.conv_stack`` (``passes/conv_matmul.py``: its strided and grouped convs as
    a gather of windows and cuBLASLt matmuls, batched over the groups for the grouped one)
    at batch 1 and 2 and lengths across the range, each first seen then replayed at new
    input addresses, equals numpy's convolutions (float64)."""
    import sys  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import conv_stack_numpy, conv_stack_weights  # pylint: disable=import-outside-toplevel

    executor = load(_artifact(f"conv_stack_{dtype}.cuda.grape"), "cuda")
    weights = conv_stack_weights(dtype)
    executor.bind_inputs({k: tvm.runtime.tensor(v, executor.device) for k, v in weights.items()})
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    rng = np.random.default_rng(12)
    sizes = [(1, 400), (2, 401), (1, 3999), (2, 8000), (1, 16000)]
    try:
        for batch, samples in sizes * 2:
            x = rng.standard_normal((batch, samples)).astype(dtype)
            got = executor.run({"x": x})
            for name, want in zip(("feat", "pos"), conv_stack_numpy(x, weights)):
                assert got[name].shape == want.shape, (name, batch, samples)
                error = float(np.abs(got[name] - want).max() / np.abs(want).max())
                assert error <= tolerance, (dtype, name, batch, samples, error)
        kernels = [k for r in executor.manifest["plan"]["regions"] for k in r["kernels"]]
        assert "grape.cublaslt.batched_matmul_nt" in kernels
        # Every call from the call program (the derived dims' cast followed), none on the VM.
        assert executor.stats.planned_calls == 2 * len(sizes)
        print(f"{dtype}: {executor.stats}")
    finally:
        executor.close()


def _library_artifact(dtype: str, matmul: str, gelu: str = "tanh", norm: bool = False) -> Path:
    """``models.library_layer`` built with ``matmul`` (bench/gpu/build_artifacts.py)."""
    if norm:
        return _artifact(f"library_{matmul}_norm_{dtype}.cuda.grape")
    if gelu == "erf":
        return _artifact(f"library_{matmul}_erf_{dtype}.cuda.grape")
    return _artifact(f"library_{dtype}.cuda.grape" if matmul == "cublaslt"
                     else f"library_{matmul}_{dtype}.cuda.grape")


@contextlib.contextmanager
def _library_executor(dtype: str, matmul: str = "cublaslt", gelu: str = "tanh",
                      norm: bool = False):
    """``models.library_layer`` (built with ``matmul``: ``library_{dtype}`` is cuBLASLt's
    alone, ``library_auto_{dtype}`` the default; ``gelu``: its GELU) loaded with its
    weights bound; yields ``run(sizes, rounds)``,
    which runs every n of ``sizes`` in a random order per round, checks y and h against
    numpy (float64) and returns the worst relative error and the executor."""
    import sys  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import library_numpy, library_weights  # pylint: disable=import-outside-toplevel

    executor = load(_library_artifact(dtype, matmul, gelu, norm), "cuda")
    weights = library_weights(dtype, norm=norm)
    executor.bind_inputs({k: tvm.runtime.tensor(v, executor.device) for k, v in weights.items()})
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    rng = np.random.default_rng(10)

    def run(sizes, rounds):
        worst = 0.0
        for n in [int(n) for _ in range(rounds) for n in rng.permutation(sizes)]:
            x = rng.standard_normal((n, 768)).astype(dtype)
            got = executor.run({"x": x})
            want_y, want_h = library_numpy(x, weights, gelu)
            for value, want in ((got["y"], want_y), (got["h"], want_h)):
                error = float(np.abs(value.astype(np.float64) - want).max() / np.abs(want).max())
                worst = max(worst, error)
                assert error <= tolerance, (dtype, n, error)
        return worst, executor

    try:
        yield run
    finally:
        executor.close()


# -- grape's GEMV kernels (passes/gemv_schedule.py) ---------------------------------------

# Rows on either side of each bucket (M <= 1, 2, 4, 8: GEMV kernels; above: dlight's Matmul)
GEMV_ROWS = (1, 2, 3, 7, 8, 9, 64, 512, 1024)


def _gemv_run(layout: str, dtype: str):
    """Run ``gemv_{layout}_{dtype}`` at every m of GEMV_ROWS twice (first sight records, the
    second replays); yield (m, name, got, float64 reference)."""
    import sys  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import gemv_test_inputs, gemv_test_numpy  # pylint: disable=import-outside-toplevel

    executor = load(_artifact(f"gemv_{layout}_{dtype}.cuda.grape"), "cuda")
    try:
        for sight in range(2):
            for m in GEMV_ROWS:
                inputs = gemv_test_inputs(m, dtype, layout, seed=100 * sight + m)
                got = executor.run(inputs)
                for name, want in zip(("y", "z"), gemv_test_numpy(inputs, layout)):
                    yield m, name, got[name], want
        yield None, "groups", executor.backend.describe()["topology_groups"], None
    finally:
        executor.close()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_gemv_kernels_equal_numpy_on_both_sides_of_every_bucket(layout, dtype):
    """``gelu(x @ W1 + b1)`` and ``x @ W2 + b2`` (K = 256; N = 516 or 520 and 102: vector and
    scalar weight loads, padded column tiles) at m = 1..1024 across the buckets, equal to
    numpy in float64 on the same inputs. fp16 sums in fp32; its inputs and outputs are fp16
    (relative error about 1e-3), hence 1e-2. The tolerance is relative to each output's
    largest value, so that values near zero are judged on the scale of their output."""
    rtol = 1e-4 if dtype == "float32" else 1e-2
    worst = {}
    for m, name, got, want in _gemv_run(layout, dtype):
        if m is None:
            continue
        assert got.dtype == np.dtype(dtype) and got.shape == want.shape
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        worst[m] = max(worst.get(m, 0.0), float(err))
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol,
                                   atol=rtol * np.abs(want).max(), err_msg=f"{name} at m={m}")
    print(f"gemv {layout} {dtype}: max |err| / max |ref| by m: "
          + ", ".join(f"{m}: {e:.1e}" for m, e in worst.items()))


@pytest.mark.parametrize("held", ["constants", "weights"])
def test_weights_stored_transposed_equal_numpy(held):
    """``gemv_test_relax`` ("kn") with its [K, N] weights bound as constants, or as inputs
    named ``weights`` and bound with ``bind_inputs``, built with the default matmul: the
    compiler stores them [N, K] (``StoreWeightsTransposed``; the executor transposes bound
    ones as it binds them), so m <= 8 runs the "nk" GEMV kernels and m above cuBLASLt's
    ``_nt`` functions. Equal to numpy (float64, the same weights) on both sides of every
    bucket, fp32 and fp16; a weight passed to ``run`` is refused."""
    import sys  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime.signature import InputError  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import gemv_test_inputs, gemv_test_numpy  # pylint: disable=import-outside-toplevel

    for dtype, rtol in (("float32", 1e-4), ("float16", 1e-2)):
        weights = {k: v for k, v in gemv_test_inputs(1, dtype, "kn", seed=7).items() if k != "x"}
        executor = load(_artifact(f"gemv_{held}_{dtype}.cuda.grape"), "cuda")
        plan = executor.manifest["plan"]
        try:
            assert plan["gemv_rows"] == {"grape.cublaslt.matmul_bias_nt": [1, 2, 4, 8]}
            if held == "weights":
                assert plan["transposed_inputs"] == ["w1", "w2"]
                with pytest.raises(InputError, match="bind it once"):
                    executor.run({"x": gemv_test_inputs(2, dtype, "kn")["x"], **weights})
                executor.bind_inputs(weights)
            for m in GEMV_ROWS:
                x = gemv_test_inputs(m, dtype, "kn", seed=m)["x"]
                got = executor.run({"x": x})
                for name, want in zip(("y", "z"), gemv_test_numpy({"x": x, **weights}, "kn")):
                    np.testing.assert_allclose(got[name].astype(np.float64), want, rtol=rtol,
                                               atol=rtol * np.abs(want).max(),
                                               err_msg=f"{held} {dtype} {name} at m={m}")
        finally:
            executor.close()


def test_gemv_buckets_are_the_topologies():
    """One launch configuration per bucket: m = 1 | 2 | 3 | 7, 8 | 9..1024 (dlight's Matmul)
    fall in five topology groups, one graph each, whatever m within a group."""
    for _, name, groups, _ in _gemv_run("kn", "float32"):
        if name != "groups":
            continue
        (region,) = groups.values()
        found = sorted(sorted(s[0] for s in g["shape_keys"]) for g in region)
        print(f"topology groups: {found}")
        assert found == [[1], [2], [3], [7, 8], [9, 64, 512, 1024]]


# A GPU hang never returns: the timeout's thread method dumps every thread and ends the
# process, so that it fails instead of stalling (a hung context serves no later test).
@pytest.mark.timeout(240, method="thread")
@pytest.mark.parametrize("matmul", ["cublaslt", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cublaslt_topologies_over_the_whole_range(dtype, matmul):
    """Algorithms chosen per bucket of n (powers of two, 11 over 1..1024): recording n over
    the range (each bucket's ends and every 9th n between) makes at most 16 topologies
    (graphs) per region. Not one per bucket: inside one algorithm cuBLAS still picks its
    kernel by M's alignment (measured on the H200: 13 topologies in fp32, 8 in fp16).
    ``matmul="auto"``: the GEMV kernels' buckets (one kernel each) stand in for cuBLASLt's
    at few rows (13 in fp32, 11 in fp16)."""
    import sys  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import library_weights  # pylint: disable=import-outside-toplevel

    executor = load(_library_artifact(dtype, matmul), "cuda")
    try:
        executor.bind_inputs({k: tvm.runtime.tensor(v, executor.device)
                              for k, v in library_weights(dtype).items()})
        edges = {e for k in range(11) for e in (1 << k, (1 << k) + 1)}
        sizes = sorted({n for n in edges | set(range(1, 1025, 9)) if n <= 1024})
        seconds = executor.record_all({"n": sizes}, progress=False)
        groups = executor.backend.describe()["topology_groups"]
        counts = {region: len(g) for region, g in groups.items()}
        spans = {region: [f"{min(s[0] for s in t['shape_keys'])}..{max(s[0] for s in t['shape_keys'])}"
                          for t in g] for region, g in groups.items()}
        print(f"{matmul} {dtype}: recorded {len(sizes)} n in 1..1024 in {seconds:.1f} s: "
              f"topologies per region {counts}, the n of each (lowest..highest): {spans}")
        assert counts and max(counts.values()) <= 16
    finally:
        executor.close()


@pytest.mark.parametrize("graph_mode", ["topology", "per-shape"])
def test_collectives_run_on_nccl_inside_the_graphs(graph_mode):
    """A model's all-reduce and all-gather (``bench/gpu/build_artifacts.py:
    collectives_model``) are calls of grape's NCCL library inside its one graph region, run
    on a communicator of one rank (``CollectiveGroup``, NCCL's own unique id): equal to
    numpy at every n, with n changing on every call. Loaded without a group, it refuses to
    run.

    One rank's NCCL copies instead of launching a kernel (a memcpy node, seen on the H200),
    which grape's graphs do not hold in either mode (they replay kernel and memset nodes
    only): that region's captures run once and are dropped, and the results still hold.
    """
    import tvm  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime.nccl import CollectiveGroup, NcclError, unique_id  # pylint: disable=import-outside-toplevel

    path = _artifact("collectives.cuda.grape")
    with load(path, "cuda") as alone, pytest.raises(NcclError, match="CollectiveGroup"):
        alone.run({"x": np.ones((1, 64), "float32"), "w": np.ones((64, 64), "float32")})
    executor = load(path, "cuda", graph_mode=graph_mode,
                    collectives=CollectiveGroup(0, 1, unique_id()))
    try:
        (region,) = executor.manifest["plan"]["regions"]
        assert {"grape.nccl.allreduce_sum", "grape.nccl.allgather"} <= set(region["kernels"])
        assert not executor.manifest["plan"]["host_steps"]
        rng = np.random.default_rng(0)
        w = rng.standard_normal((64, 64)).astype("float32")
        executor.bind_inputs({"w": tvm.runtime.tensor(w, executor.device)})
        for n in (1, 7, 64, 3, 256, 1, 100):
            x = rng.standard_normal((n, 64)).astype("float32")
            got = executor.run({"x": x})
            want = x.astype(np.float64) @ w + x
            for name in ("y", "g"):
                np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-4,
                                           err_msg=f"{name} at n={n}")
        backend = executor.backend.describe()
        print(f"collectives, {graph_mode}: {backend['graphs_captured']} captured, "
              f"{backend['graphs_instantiated']} instantiated, not kept: "
              f"{backend['not_kept_reason']}")
        # as seen on the H200: NCCL at one rank copies (a memcpy node), so no graph is kept
        assert backend["graphs_instantiated"] == 0, backend
        assert "MEMCPY" in backend["not_kept_reason"], backend
    finally:
        executor.close()


def test_copy_part_takes_a_ranks_slice_on_the_device():
    """``cuda_driver.copy_part`` (a tensor-parallel rank's part of a whole input, taken on
    the device by one strided copy) equals numpy's slice, for every axis and part, fp32 and
    fp16, on shapes whose leading and trailing extents are 1 or more."""
    import tvm  # pylint: disable=import-outside-toplevel

    from grape_tvm.runtime.cuda_driver import check, copy_part, driver  # pylint: disable=import-outside-toplevel

    device = tvm.cuda(0)
    stream = check(driver.cuStreamCreate(0), "cuStreamCreate")
    try:
        rng = np.random.default_rng(0)
        for shape in ((8,), (4, 6), (3, 4, 10), (2, 8, 5, 3)):
            for dtype in ("float32", "float16"):
                whole = rng.standard_normal(shape).astype(dtype)
                on_device = tvm.runtime.tensor(whole, device)
                for axis, extent in enumerate(shape):
                    for parts in (p for p in (2, 4) if extent % p == 0):
                        for index in range(parts):
                            part_shape = list(shape)
                            part_shape[axis] //= parts
                            out = tvm.runtime.empty(tuple(part_shape), dtype, device)
                            copy_part(on_device, out, axis, index, parts, stream)
                            check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
                            want = np.split(whole, parts, axis=axis)[index]
                            np.testing.assert_array_equal(out.numpy(), want,
                                                          err_msg=f"{shape} {dtype} axis {axis} "
                                                                  f"part {index}/{parts}")
    finally:
        driver.cuStreamDestroy(stream)
