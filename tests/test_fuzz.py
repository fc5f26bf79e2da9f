"""Fuzzing the executor against TVM's VM (CPU): random shapes within the declared range,
one tensor passed for several inputs, overlapping views, outputs fed back, repeated and
permuted calls, bound and unbound inputs, a small shape bound, several executors in
threads. The CPU replay runs TVM's own kernels: every result must equal the VM's exactly."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tvm
from tvm.runtime.vm import VirtualMachine

import grape_tvm
from grape_tvm.loader import load, load_library
from test_executor_lifecycle import WIDTH, _aligned_rows, _attention_module

HI = 24
CALLS = 60


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "attention.grape"
    grape_tvm.build(_attention_module(), {"n": (1, HI)}, "llvm",
                    output_names=["y", "z"]).export(path)
    return path


class Reference:
    """TVM's VM on the same library; calls serialized (one VM, several threads)."""

    def __init__(self, path):
        library, _, dev = load_library(path, "cpu")
        self.vm = VirtualMachine(library, dev)
        self.lock = threading.Lock()

    def __call__(self, q, k, v) -> list[np.ndarray]:
        with self.lock:
            tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in (q, k, v)]
            return [t.numpy() for t in self.vm["main"](*tensors)]


def _inputs(rng, n: int, last_y):  # pylint: disable=too-many-return-statements
    """(q, k, v) as passed, and as numpy for the reference: fresh arrays, one tensor for
    several inputs, overlapping views, or the last call's output fed back."""
    fresh = [rng.standard_normal((n, WIDTH)).astype(np.float32) for _ in range(3)]
    kind = rng.integers(5)
    if kind == 1:  # self-attention: q = k = v, one device tensor
        one = tvm.runtime.tensor(fresh[0])
        return (one, one, one), (fresh[0],) * 3
    if kind == 2:  # q = k, one tensor; v its own
        one = tvm.runtime.tensor(fresh[0])
        return (one, one, fresh[2]), (fresh[0], fresh[0], fresh[2])
    if kind == 3:  # q and k overlapping views of one buffer, read in place
        rows = _aligned_rows(rng.standard_normal((n + 1, WIDTH)).astype(np.float32))
        q, k = tvm.runtime.from_dlpack(rows[:n]), tvm.runtime.from_dlpack(rows[1:])
        return (q, k, fresh[2]), (rows[:n].copy(), rows[1:].copy(), fresh[2])
    if kind == 4 and last_y is not None and last_y.shape[0] == n:  # an output fed back
        return (last_y, fresh[1], last_y), (last_y.numpy(), fresh[1], last_y.numpy())
    return tuple(fresh), tuple(fresh)


def _fuzz(executor, reference: Reference, seed: int, bound_v: np.ndarray | None,
          feed_back: bool) -> int:
    """Random calls on ``executor``; returns how many differ from the VM. ``feed_back``:
    no other thread calls the executor, so its outputs can be read in place (they are valid
    until its next call) and passed back as the next call's input; else they come back as
    numpy arrays, copied inside the call."""
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(1, HI + 1, size=6)] + [1, HI]
    mismatches, last_y = 0, None
    for _ in range(CALLS):
        n = int(rng.choice(sizes)) if rng.random() < 0.8 else int(rng.integers(1, HI + 1))
        if bound_v is not None and n != bound_v.shape[0]:
            n = bound_v.shape[0]  # v's dims are fixed by the bound tensor
        (q, k, v), (qn, kn, vn) = _inputs(rng, n, last_y)
        inputs = {"q": q, "k": k}
        if bound_v is None:
            inputs["v"] = v
        else:
            vn = bound_v
        got = executor.run(inputs, return_numpy=not feed_back)
        want = reference(qn, kn, vn)
        mismatches += not all(np.array_equal(_numpy(got[name]), w)
                              for name, w in zip(("y", "z"), want))
        last_y = got["y"] if feed_back else None
    return mismatches


def _numpy(value) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.numpy()


def test_fuzz_against_the_vm_in_threads(artifact):
    reference = Reference(artifact)
    bound_v = np.random.default_rng(99).standard_normal((7, WIDTH)).astype(np.float32)
    plain = load(artifact, "cpu")
    bounded = load(artifact, "cpu", max_shapes=3)
    with_bound = load(artifact, "cpu")
    with_bound.bind_inputs({"v": bound_v})
    shared = load(artifact, "cpu")
    jobs = [(plain, 1, None), (bounded, 2, None), (with_bound, 3, bound_v),
            (shared, 4, None), (shared, 5, None)]
    results: dict[int, int] = {}
    errors: list[BaseException] = []

    def work(index, executor, seed, bound):
        try:
            results[index] = _fuzz(executor, reference, seed, bound,
                                   feed_back=executor is not shared)
        except BaseException as err:  # pylint: disable=broad-except
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {i: 0 for i in range(len(jobs))}
    assert bounded.stats.evicted_shapes > 0 and bounded.stats.plans_held <= 3
    assert plain.stats.unrecorded_calls > 0 and plain.stats.planned_calls > 0
    for executor in (plain, bounded, with_bound, shared):
        executor.close()
