"""Tensor parallelism on the CPU (``passes/tensor_parallel.py``): a GPT-2 decode step
annotated for 2 and 4 devices, lowered to the program each rank runs, run by that many
threads with numpy stand-ins for disco's collectives (this TVM wheel has no CPU collectives:
``init_ccl`` takes NCCL or RCCL only), equals the step's numpy reference, at several
cache lengths: with its inputs whole (scattered on every call), and with each rank handed
its own part once (``LocalParams``); and ``TensorParallelSession`` on a disco session. Nothing
here runs NCCL: GPUs only."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

from grape_tvm.passes.tensor_parallel import (SHARD_PLAN_ATTR, LocalParams, LowerTensorParallel,
                                               shard_inputs)

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from models import (gpt2_decode_step, gpt2_numpy, gpt2_qkv_by_ranks,  # noqa: E402  pylint: disable=wrong-import-position
                    gpt2_shapes)

HIDDEN, HEADS, LAYERS = 64, 4, 2
def _per_rank(world: int, local: bool = False) -> tvm.IRModule:
    mod = LowerTensorParallel()(gpt2_decode_step(HIDDEN, HEADS, LAYERS, tensor_parallel=world))
    return LocalParams()(mod) if local else mod


def _ccl_calls(mod: tvm.IRModule) -> list[str]:
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and \
                expr.op.name.startswith("relax.ccl."):
            found.append(expr.op.name)

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_runs_its_heads_and_mlp_columns(world):
    """Megatron's collectives and no more: two all-reduces a layer (after attention's output
    projection and the MLP's second matmul); the qkv product, the MLP's weights and the
    caches local."""
    mod = _per_rank(world)
    calls = _ccl_calls(mod)
    assert calls.count("relax.ccl.allreduce") == 2 * LAYERS, calls
    text = mod["main"].script()
    assert f"R.Tensor((1, {3 * HIDDEN // world})" in text  # the qkv product's columns
    assert f"R.Tensor(({HIDDEN}, {4 * HIDDEN // world})" in text  # w_fc's columns
    assert f"R.Tensor(({4 * HIDDEN // world}, {HIDDEN})" in text  # w_proj's rows
    assert f"R.Tensor(({HEADS // world}, past + 1, {HIDDEN // HEADS})" in text  # a present


def test_local_params_leave_only_the_all_reduces():
    """Weights split once and caches kept per rank: no collective but the all-reduces; the
    shard plan names what is split and on which axis."""
    mod = _per_rank(2, local=True)
    assert set(_ccl_calls(mod)) == {"relax.ccl.allreduce"}
    plan = {str(k): int(v) for k, v in mod["main"].attrs[SHARD_PLAN_ATTR].items()}
    for i in range(LAYERS):
        assert {f"past_k{i}": 0, f"past_v{i}": 0, f"w_qkv{i}": 1, f"b_qkv{i}": 0, f"w_o{i}": 0,
                f"w_fc{i}": 1, f"b_fc{i}": 0, f"w_proj{i}": 0}.items() <= plan.items()
    assert "x" not in plan and "b_o0" not in plan  # replicated: each rank takes it whole


def test_local_params_keep_the_collectives_of_values_read_whole_or_computed():
    """A parameter read by its scatter alone becomes its part; one also read whole, and a
    value computed inside, keep their collectives; a broadcast parameter is read as it is."""
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 6), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            w_part = bb.emit(relax.op.ccl.scatter_from_worker0(w, 2, 1))      # w: (8, 3)
            x_whole = bb.emit(relax.op.ccl.broadcast_from_worker0(x))
            product = bb.emit(relax.op.matmul(x_whole, w_part))
            kept = bb.emit(relax.op.ccl.scatter_from_worker0(product, 2, 0))  # computed
            x_part = bb.emit(relax.op.ccl.scatter_from_worker0(x, 2, 0))      # x read twice
            out = bb.emit_output(relax.Tuple([kept, x_part]))
        bb.emit_func_output(out)
    mod = LocalParams()(bb.get().with_attr("device_num", 2))
    main = mod["main"]
    assert [tuple(int(d) for d in p.ty.shape.values) for p in main.params] == [(4, 8), (8, 3)]
    assert {str(k): int(v) for k, v in main.attrs[SHARD_PLAN_ATTR].items()} == {"w": 1}
    assert sorted(_ccl_calls(mod)) == ["relax.ccl.scatter_from_worker0"] * 2


def _on_ranks(standin, step) -> list:
    """``step(rank)`` on every rank (``standin``: conftest's ``_Collectives``), a thread
    each (its rank set for the collectives): the results in rank order; the first error
    fails the test (the others' barrier aborted)."""
    results: list = [None] * standin.world
    errors: list = []

    def run(rank: int) -> None:
        standin.local.rank = rank
        try:
            results[rank] = step(rank)
        except BaseException as error:  # pylint: disable=broad-except
            errors.append(error)
            standin.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(standin.world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


def _equal_one_device(outputs: list, x, caches, weights) -> None:
    """Every rank's y equals the step's (replicated); its caches, joined in rank order along
    the heads, equal the step's."""
    y, presents = gpt2_numpy(x, caches, weights, HEADS, LAYERS)
    for rank_outputs in outputs:
        np.testing.assert_allclose(rank_outputs[0], y, rtol=1e-5, atol=1e-5)
    for i, present in enumerate(presents):
        joined = np.concatenate([rank_outputs[1 + i] for rank_outputs in outputs], axis=0)
        np.testing.assert_allclose(joined, present, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world, local", [(2, False), (4, False), (2, True), (4, True)])
def test_ranks_together_equal_one_device(world, local, collectives):
    standin = collectives(world)
    per_rank = _per_rank(world, local)
    executable = tvm.compile(per_rank, target="llvm")
    names = [p.name for p in per_rank["main"].params]
    rng = np.random.default_rng(world)
    weights = {k: (0.1 * rng.standard_normal(s)).astype("float32")
               for k, s in gpt2_shapes(HIDDEN, LAYERS).items()}
    d = HIDDEN // HEADS
    for past in (1, 5, 17):
        x = rng.standard_normal((1, HIDDEN)).astype("float32")
        caches = [rng.standard_normal((HEADS, past, d)).astype("float32")
                  for _ in range(2 * LAYERS)]
        ordered = gpt2_qkv_by_ranks(weights, HEADS, world)  # qkv columns in rank order
        whole = dict(zip(names, [x, *caches, *(ordered[k] for k in weights)]))

        def step(rank: int) -> list:
            inputs = shard_inputs(per_rank, whole, rank) if local else whole
            vm = relax.VirtualMachine(executable, tvm.cpu())
            return [o.numpy() for o in vm["main"](*(tvm.runtime.tensor(inputs[name])
                                                     for name in names))]

        _equal_one_device(_on_ranks(standin, step), x, caches, weights)


@pytest.mark.parametrize("reduction", ["sum", "max", "min", "avg"])
def test_grapes_collectives_reduce_and_gather_as_the_model_says(reduction, collectives,
                                                                 tmp_path):
    """A model's ``R.ccl.allreduce`` (each reduction) and ``allgather``, built by grape
    (``CollectivesAsLibraryCalls``: calls of ``grape.nccl.*`` inside the graph region; on
    the CPU they call disco's collectives, here conftest's stand-ins), run on two ranks
    (threads) with different inputs: every rank gets numpy's reduction and the ranks'
    inputs stacked, at several n."""
    import grape_tvm  # pylint: disable=import-outside-toplevel

    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            reduced = bb.emit(relax.op.ccl.allreduce(x, reduction, in_group=False))
            gathered = bb.emit(relax.op.ccl.allgather(x, num_workers=2, in_group=False))
            out = bb.emit_output(relax.Tuple([reduced, gathered]))
        bb.emit_func_output(out)
    module = grape_tvm.build(bb.get(), {"n": (1, 8)}, "llvm", output_names=["r", "g"])
    (region,) = module.plan["regions"]
    assert region["kernels"] == [f"grape.nccl.allreduce_{reduction}", "grape.nccl.allgather"]
    path = module.export(tmp_path / "collectives.grape")
    standin = collectives(2)
    numpy_reduction = {"sum": np.sum, "max": np.max, "min": np.min, "avg": np.mean}[reduction]
    for size in (1, 3, 8):
        xs = [np.random.default_rng([size, r]).standard_normal((size, 4)).astype("float32")
              for r in range(2)]

        def step(rank: int, xs=xs) -> dict:
            with grape_tvm.load(path) as executor:
                return executor.run({"x": xs[rank]})

        for got in _on_ranks(standin, step):
            np.testing.assert_allclose(got["r"], numpy_reduction(xs, axis=0), rtol=1e-6)
            np.testing.assert_array_equal(got["g"], np.concatenate(xs))


def test_build_holds_each_ranks_program_and_its_shard_plan(collectives, tmp_path):
    """``grape_tvm.build(..., tensor_parallel=2)``: one artifact, the program every rank runs
    (grape's pipeline, its all-reduces calls of grape's NCCL library inside its graph regions,
    which on the CPU call disco's collectives) and the shard plan;
    two executors loaded from it, each bound its rank's part of the weights and caches
    (``runtime.tensor_parallel.rank_inputs``), run as two threads with the stand-in
    collectives: together they equal the one-device numpy reference."""
    import grape_tvm  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime.tensor_parallel import rank_inputs  # pylint: disable=import-outside-toplevel

    world = 2
    standin = collectives(world)
    module = grape_tvm.build(gpt2_decode_step(HIDDEN, HEADS, LAYERS, tensor_parallel=world),
                             {"past": (1, 32)}, "llvm", tensor_parallel=world)
    path = module.export(tmp_path / "step.grape")
    parallel = module.manifest()["plan"]["tensor_parallel"]
    assert parallel["world_size"] == world and parallel["shard_plan"]  # weights and caches
    outputs = [spec.name for spec in module.signature.outputs]  # y, then the caches
    assert parallel["output_shard_plan"] == {name: 0 for name in outputs[1:]}
    _assert_all_reduces_in_regions(module.plan)
    names = [spec.name for spec in module.signature.inputs]
    rng = np.random.default_rng(7)
    weights = {k: (0.1 * rng.standard_normal(s)).astype("float32")
               for k, s in gpt2_shapes(HIDDEN, LAYERS).items()}
    d = HIDDEN // HEADS
    x = rng.standard_normal((1, HIDDEN)).astype("float32")
    caches = [rng.standard_normal((HEADS, 9, d)).astype("float32") for _ in range(2 * LAYERS)]
    ordered = gpt2_qkv_by_ranks(weights, HEADS, world)
    whole = dict(zip(names, [x, *caches, *(ordered[k] for k in weights)]))

    def step(rank: int) -> list:
        with grape_tvm.load(path) as executor:
            mine = rank_inputs(parallel["shard_plan"], world, whole, rank)
            return list(executor.run(mine).values())

    _equal_one_device(_on_ranks(standin, step), x, caches, weights)


def test_each_ranks_matmuls_are_ops_again_at_its_shapes():
    """``RaiseLegalizedOps``: every matmul and transpose of a rank's program is the Relax op
    again, at the rank's shapes (no ``call_tir`` of a legalized matmul is left), and the
    all-reduces stay where they were."""
    mod = _per_rank(2, local=True)
    ops = []
    relax.analysis.post_order_visit(mod["main"], lambda e: isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and ops.append(e.op.name))
    assert ops.count("relax.matmul") == 6 * LAYERS  # qkv, scores, weighted sum, out, fc, proj
    assert ops.count("relax.permute_dims") >= 4 * LAYERS
    assert ops.count("relax.ccl.allreduce") == 2 * LAYERS
    functions = [gvar.name_hint for gvar in mod.get_global_vars()]
    assert not [name for name in functions if name.startswith(("matmul", "transpose"))], functions
    text = mod["main"].script()
    assert f'R.Tensor((1, {3 * HIDDEN // 2}), dtype="float32") = R.matmul(' in text
    relax.analysis.well_formed(mod)  # raises where it is not


def test_raise_legalized_ops_gives_back_the_ops_on_a_tiny_module():
    """On one device: a matmul by a transposed weight plus a bias, scaled by a scalar
    constant, under a softmax, legalized with the tags and raised back, is the module
    legalized without touching ``RAISED_OPS``: those ops as they were (the scalar back in
    place), the exp (not one of them) and the add of a non-scalar constant (which a rank
    would hold a part of) TVM's legalization."""
    from grape_tvm.passes.tensor_parallel import (  # pylint: disable=import-outside-toplevel
        RAISED_OPS, RaiseLegalizedOps, _legalize_tagged)

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((tvm.tirx.Var("n", "int64"), 8), "float32"))
    w = relax.Var("w", relax.TensorType((6, 8), "float32"))
    b = relax.Var("b", relax.TensorType((6,), "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w, [1, 0]))))
            scaled = bb.emit(relax.op.multiply(relax.op.add(y, b), relax.const(0.5, "float32")))
            shifted = bb.emit(relax.op.add(scaled, relax.const(np.arange(6, dtype="float32"))))
            out = bb.emit_output(relax.op.exp(relax.op.nn.softmax(shifted)))
        bb.emit_func_output(out)
    mod = bb.get()
    tagged = relax.transform.LegalizeOps({op: _legalize_tagged(op) for op in RAISED_OPS})(mod)
    raised = RaiseLegalizedOps()(tagged)
    ops = []
    relax.analysis.post_order_visit(raised["main"], lambda e: isinstance(e, relax.Call) and ops.append(
        e.op.name if isinstance(e.op, tvm.ir.Op) else "call"))
    assert sorted(o for o in ops if o != "relax.call_tir") == sorted([
        "relax.permute_dims", "relax.matmul", "relax.add", "relax.multiply", "relax.nn.softmax"]), ops
    assert ops.count("relax.call_tir") == 2, ops  # the exp, and the add of the large constant
    scaled = [c for c in _calls(raised["main"], "relax.multiply")]
    assert float(scaled[0].args[1].value.numpy()) == 0.5  # the scalar back in place
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor(rng.standard_normal(shape).astype("float32"))
            for shape in ((3, 8), (6, 8), (6,))]
    got, want = (relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())["main"](*args)
                 for m in (raised, relax.transform.LegalizeOps()(mod)))
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)


def _calls(func: relax.Function, op_name: str) -> list:
    found = []
    relax.analysis.post_order_visit(func, lambda e: isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and e.op.name == op_name and found.append(e))
    return found


def test_a_ranks_decode_attention_is_one_fused_kernel():
    """A decode step's attention split by heads: each rank's scale and softmax are Relax ops
    again (``RaiseLegalizedOps``), so FuseAttention makes the rank's attention one call of
    grape's decode attention kernel, as on one device (not two cuBLASLt products around a
    softmax kernel)."""
    import grape_tvm  # pylint: disable=import-outside-toplevel
    from grape_tvm.passes.tensor_parallel import shard, with_mesh  # pylint: disable=import-outside-toplevel

    heads, head_dim, world = 4, 64, 2
    past = tvm.tirx.Var("past", "int64")
    q = relax.Var("q", relax.TensorType((1, heads, 1, head_dim), "float32"))
    k = relax.Var("k", relax.TensorType((1, heads, past, head_dim), "float32"))
    v = relax.Var("v", relax.TensorType((1, heads, past, head_dim), "float32"))
    bb = relax.BlockBuilder()
    op = relax.op
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            qs, ks, vs = (shard(bb, t, "S[1]", world) for t in (q, k, v))
            scores = bb.emit(op.multiply(op.matmul(qs, op.permute_dims(ks, [0, 1, 3, 2])),
                                         relax.const(head_dim ** -0.5, "float32")))
            out = bb.emit(op.matmul(op.nn.softmax(scores, axis=-1), vs))
            out = bb.emit_output(shard(bb, out, "S[1]", world))
        bb.emit_func_output(out)
    module = grape_tvm.build(with_mesh(bb.get(), world), {"past": (1, 64)},
                             tvm.target.Target({"kind": "cuda", "arch": "sm_90"}),
                             tensor_parallel=world, prebuild_cubin=False)
    kernels = [k for r in module.plan["regions"] for k in r["kernels"]]
    assert kernels == ["grape.decode_attention.fused"], kernels


def test_a_sharded_cuda_build_runs_its_matmuls_on_cublaslt():
    """A rank's program goes through grape's pipeline: on CUDA its weight matmuls and
    attention's products are cuBLASLt calls inside the graph regions."""
    import grape_tvm  # pylint: disable=import-outside-toplevel

    module = grape_tvm.build(gpt2_decode_step(HIDDEN, HEADS, LAYERS, tensor_parallel=2),
                             {"past": (1, 32)}, tvm.target.Target({"kind": "cuda",
                                                                   "arch": "sm_90"}),
                             tensor_parallel=2, prebuild_cubin=False, matmul="cublaslt")
    kernels = [k for r in module.plan["regions"] for k in r["kernels"]]
    # A layer: the qkv and fc products with their biases (column-parallel), the two
    # attention products, and the two row-parallel products, whose bias and residual follow
    # the all-reduce.
    assert sum(k.startswith("grape.cublaslt.") for k in kernels) == 6 * LAYERS, kernels
    assert kernels.count("grape.cublaslt.matmul_bias") == 2 * LAYERS, kernels
    assert kernels.count("grape.cublaslt.matmul") == 2 * LAYERS, kernels
    assert module.plan["libraries"] == ["cublaslt", "nccl"]
    assert module.plan["tensor_parallel"]["world_size"] == 2
    _assert_all_reduces_in_regions(module.plan)


def _assert_all_reduces_in_regions(plan: dict) -> None:
    """Two all-reduces a layer, each a kernel of a graph region; none a host step."""
    kernels = [k for r in plan["regions"] for k in r["kernels"]]
    assert kernels.count("grape.nccl.allreduce_sum") == 2 * LAYERS, kernels
    host = [step["op"] for step in plan["host_steps"]]
    assert not [op for op in host if "disco" in op or "nccl" in op], host
    assert len(plan["regions"]) == 1, [r["kernels"] for r in plan["regions"]]


def test_build_refuses_a_module_without_annotations():
    import grape_tvm  # pylint: disable=import-outside-toplevel

    with pytest.raises(ValueError, match="no sharding annotations"):
        grape_tvm.build(gpt2_decode_step(HIDDEN, HEADS, LAYERS), {"past": (1, 32)}, "llvm",
                        tensor_parallel=2)


def test_rank_inputs_split_what_the_plan_names_and_refuse_what_does_not_split():
    from grape_tvm.runtime.tensor_parallel import rank_inputs  # pylint: disable=import-outside-toplevel

    w, x = np.arange(24).reshape(4, 6), np.arange(3)
    mine = rank_inputs({"w": 1}, 2, {"w": w, "x": x}, 1)
    np.testing.assert_array_equal(mine["w"], w[:, 3:])
    assert mine["x"] is x
    with pytest.raises(ValueError, match="'w' of shape \\(4, 6\\) does not split in 4"):
        rank_inputs({"w": 1}, 4, {"w": w}, 0)
    with pytest.raises(ValueError, match="rank 2 is not one of the 2 ranks"):
        rank_inputs({"w": 1}, 2, {"w": w}, 2)


@pytest.fixture(scope="module")
def step_artifact(tmp_path_factory):
    import grape_tvm  # pylint: disable=import-outside-toplevel

    module = grape_tvm.build(gpt2_decode_step(HIDDEN, HEADS, LAYERS, tensor_parallel=2),
                             {"past": (1, 32)}, "llvm", tensor_parallel=2)
    return module, module.export(tmp_path_factory.mktemp("tp") / "step.grape")


def test_a_session_of_two_disco_workers_equals_one_device(step_artifact, disco_collectives):
    """``TensorParallelSession`` on a threaded disco session of two workers (its collectives
    numpy stand-ins: no CPU collectives here): the weights bound once, whole, each worker
    keeping its part; then calls at several cache lengths, inputs whole, each call's caches
    the outputs of the one before: y and the caches (gathered from both ranks, whole) equal
    the one-device step's; ``describe`` gives each rank's backend."""
    from grape_tvm.tensor_parallel_session import TensorParallelSession  # pylint: disable=import-outside-toplevel

    module, path = step_artifact
    disco_collectives(2)
    names = [spec.name for spec in module.signature.inputs]
    rng = np.random.default_rng(3)
    weights = {k: (0.1 * rng.standard_normal(s)).astype("float32")
               for k, s in gpt2_shapes(HIDDEN, LAYERS).items()}
    ordered = gpt2_qkv_by_ranks(weights, HEADS, 2)
    d = HIDDEN // HEADS
    with TensorParallelSession(path, threaded=True, ccl=None) as ranks:
        ranks.bind_inputs({k: ordered[k] for k in weights})
        caches = [rng.standard_normal((HEADS, 7, d)).astype("float32") for _ in range(2 * LAYERS)]
        for _ in range(3):
            x = rng.standard_normal((1, HIDDEN)).astype("float32")
            outputs = list(ranks.run(dict(zip(names, [x, *caches]))).values())
            y, presents = gpt2_numpy(x, caches, weights, HEADS, LAYERS)
            np.testing.assert_allclose(outputs[0], y, rtol=1e-5, atol=1e-5)
            for got, present in zip(outputs[1:], presents):
                np.testing.assert_allclose(got, present, rtol=1e-5, atol=1e-5)
            caches = outputs[1:]  # fed back whole, as one device's
        described = ranks.describe()  # each rank's own backend, which recorded the calls
        assert [d["backend"] for d in described] == ["cpu-replay"] * 2, described
        assert all(d["topology_groups"] for d in described), described


def test_a_session_refuses_a_one_device_artifact_and_a_wrong_device_count(step_artifact,
                                                                            tmp_path):
    import grape_tvm  # pylint: disable=import-outside-toplevel
    from grape_tvm.artifact import ArtifactError  # pylint: disable=import-outside-toplevel
    from grape_tvm.tensor_parallel_session import TensorParallelSession  # pylint: disable=import-outside-toplevel

    one = grape_tvm.build(gpt2_decode_step(HIDDEN, HEADS, 1), {"past": (1, 8)}, "llvm")
    with pytest.raises(ArtifactError, match="built for one device"):
        TensorParallelSession(one.export(tmp_path / "one.grape"), threaded=True, ccl=None)
    with pytest.raises(ValueError, match="runs on 2 distinct devices, got \\[0, 1, 2\\]"):
        TensorParallelSession(step_artifact[1], devices=[0, 1, 2], threaded=True, ccl=None)


_PROCESS_SESSION = """
import gc, sys, time
from grape_tvm.tensor_parallel_session import TensorParallelSession
ranks = TensorParallelSession(sys.argv[1], ccl=None)
ranks.close()
ranks.close()
time.sleep(1.5)  # the worker process has exited
del ranks
gc.collect()
left_open = [TensorParallelSession(sys.argv[1], ccl=None),
             TensorParallelSession(sys.argv[1], threaded=True, ccl=None)]
print("closed")
"""


def test_a_process_session_loads_in_every_worker_and_closes_cleanly(step_artifact):
    """A ``ProcessSession`` (the per-GPU form; worker 1 a process of grape's entrypoint,
    ``grape_tvm.rank_worker``): every worker loads an executor of the artifact (the session
    checks each), and closing twice, then dropping the session after its worker exited, ends
    the process normally (it wrote to the dead worker and aborted before); so does exiting
    with a process and a threaded session left open (closed at exit: they aborted at
    finalization before). In a process of its own: calls need collectives across processes,
    which this CPU machine has none of."""
    import subprocess  # pylint: disable=import-outside-toplevel

    done = subprocess.run([sys.executable, "-c", _PROCESS_SESSION, str(step_artifact[1])],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "closed" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_bad_input_fails_before_the_ranks_and_the_session_goes_on(step_artifact,
                                                                   disco_collectives):
    """Inputs are checked as a rank's executor would check them, before anything is sent: a
    float64 input, a missing one and an unknown one raise ``InputError`` naming it, and the
    session runs the next call."""
    from grape_tvm.runtime.signature import InputError  # pylint: disable=import-outside-toplevel
    from grape_tvm.tensor_parallel_session import TensorParallelSession  # pylint: disable=import-outside-toplevel

    module, path = step_artifact
    disco_collectives(2)
    names = [spec.name for spec in module.signature.inputs]
    weights = {k: np.zeros(s, "float32") for k, s in gpt2_shapes(HIDDEN, LAYERS).items()}
    caches = [np.zeros((HEADS, 4, HIDDEN // HEADS), "float32") for _ in range(2 * LAYERS)]
    good = dict(zip(names, [np.zeros((1, HIDDEN), "float32"), *caches]))
    with TensorParallelSession(path, threaded=True, ccl=None) as ranks:
        ranks.bind_inputs(weights)
        with pytest.raises(InputError, match="input 'x' has dtype float64"):
            ranks.run({**good, "x": np.zeros((1, HIDDEN))})
        with pytest.raises(InputError, match="missing input"):
            ranks.run({k: v for k, v in good.items() if k != "x"})
        with pytest.raises(InputError, match="unknown input"):
            ranks.run({**good, "y": np.zeros(1, "float32")})
        outputs = ranks.run(good)
        assert outputs[module.signature.outputs[0].name].shape == (1, HIDDEN)
    with pytest.raises(RuntimeError, match="session is closed"):
        ranks.run(good)


def test_a_worker_that_fails_raises_rank_error(tmp_path, monkeypatch):
    """A worker's failure comes back as ``RankError`` naming its rank (disco would end the
    process on a worker's exception): a CUDA artifact on a session of CPU workers, given an
    NCCL group id (this machine has no NCCL to make one), fails in every worker's load. A
    CUDA artifact's ranks talk through NCCL: ``ccl=None`` is refused before any starts."""
    import grape_tvm  # pylint: disable=import-outside-toplevel
    from grape_tvm import tensor_parallel_session  # pylint: disable=import-outside-toplevel
    from grape_tvm.tensor_parallel_session import RankError, TensorParallelSession  # pylint: disable=import-outside-toplevel

    module = grape_tvm.build(gpt2_decode_step(HIDDEN, HEADS, 1, tensor_parallel=2),
                             {"past": (1, 8)}, tvm.target.Target({"kind": "cuda",
                                                                   "arch": "sm_90"}),
                             tensor_parallel=2, prebuild_cubin=False, matmul="tvm")
    path = module.export(tmp_path / "cuda.grape")
    with pytest.raises(ValueError, match="talk through NCCL"):
        TensorParallelSession(path, threaded=True, ccl=None)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setattr(tensor_parallel_session, "unique_id", lambda: bytes(128))
    with pytest.raises(RankError, match="rank 0: "):
        TensorParallelSession(path, threaded=True, ccl="nccl")


def test_a_failure_on_one_rank_raises_rank_error_and_the_session_goes_on(step_artifact,
                                                                         disco_collectives):
    """A run that fails on rank 1 alone (after its program ran, as a late device error
    would) raises ``RankError`` naming rank 1, before any output is gathered (a worker
    handed an error for outputs ended the process before); the next call runs."""
    from grape_tvm import tensor_parallel_session as tps  # pylint: disable=import-outside-toplevel

    module, path = step_artifact
    disco_collectives(2)
    worker_id = tvm.get_global_func("runtime.disco.worker_id")

    class FailingOnRank1:
        def __init__(self, executor):
            self.executor, self.device = executor, executor.device

        def run(self, *args, **kwargs):
            outputs = self.executor.run(*args, **kwargs)
            if int(worker_id()[0]) == 1:
                raise RuntimeError("late failure")
            return outputs

    names = [spec.name for spec in module.signature.inputs]
    weights = {k: np.zeros(s, "float32") for k, s in gpt2_shapes(HIDDEN, LAYERS).items()}
    caches = [np.zeros((HEADS, 3, HIDDEN // HEADS), "float32") for _ in range(2 * LAYERS)]
    good = dict(zip(names, [np.zeros((1, HIDDEN), "float32"), *caches]))
    with tps.TensorParallelSession(path, threaded=True, ccl=None) as ranks:
        ranks.bind_inputs(weights)
        held = dict(tps._EXECUTORS)  # pylint: disable=protected-access
        tps._EXECUTORS.update({h: FailingOnRank1(e) for h, e in held.items()})  # pylint: disable=protected-access
        try:
            with pytest.raises(tps.RankError, match="rank 1: RuntimeError: late failure"):
                ranks.run(good)
        finally:
            tps._EXECUTORS.update(held)  # pylint: disable=protected-access
        assert ranks.run(good)[module.signature.outputs[0].name].shape == (1, HIDDEN)


def test_joined_puts_the_ranks_slices_back_along_their_axis():
    from grape_tvm.runtime.tensor_parallel import joined  # pylint: disable=import-outside-toplevel

    whole = np.arange(4 * 6 * 8).reshape(4, 6, 8)
    for axis in range(3):
        np.testing.assert_array_equal(joined(np.stack(np.split(whole, 2, axis=axis)), axis), whole)


def test_output_axes_name_one_static_split_and_refuse_the_rest():
    """``build``'s ``output_shard_plan``: an output split along one static axis names it; one
    held whole names none; a split of a symbolic size, an output of unknown shape, or a
    different number of outputs is refused."""
    from grape_tvm.compiler import _output_axes  # pylint: disable=import-outside-toplevel

    n = tvm.tirx.Var("n", "int64")

    def tensors(*shapes):
        return relax.TupleType([relax.TensorType(shape, "float32") for shape in shapes])

    assert _output_axes(tensors((1, 64), (4, n, 16)), tensors((1, 64), (2, n, 16)), 2) == [None, 0]
    with pytest.raises(ValueError, match="not one axis of static size split in 2"):
        _output_axes(tensors((4, n)), tensors((4, n // 2)), 2)
    with pytest.raises(ValueError, match="not one axis of static size split in 2"):
        _output_axes(tensors((4, 6)), tensors((4, 2)), 2)
    with pytest.raises(ValueError, match="tensor of known shape"):
        _output_axes(tensors((4,)), relax.TupleType([relax.TensorType(ndim=1, dtype="float32")]), 2)
    with pytest.raises(ValueError, match="2 outputs on one device and 1 on a rank"):
        _output_axes(tensors((4,), (4,)), tensors((4,)), 2)
