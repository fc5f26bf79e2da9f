"""The ``grape`` Relax pipeline: TVM's lowering with graph regions in place of TVM's CUDA graphs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import tvm
from tvm import relax
from tvm.ir.transform import PassContext, module_pass

from grape_tvm.artifact import MATMUL_IMPLEMENTATIONS
from grape_tvm.passes import (BoundShapeRanges, BranchesToConditionalRegions,
                              CheckDeviceKernels, CollectivesAsLibraryCalls,
                              CopyPassThroughBranches,
                              DescribeCallProgram, DescribeConditionals, FoldShapeTensors,
                              FuseAttention, FuseGathers, FuseIntoConcatenations,
                              FuseIntoInplaceWrites,
                              FuseWeightTranspose, HoistBranchStorage,
                              HoistReductionInit,
                              KernelAttributes,
                              IfToSelect,
                              InlineBranches, OutlineBranches,
                              LiftGraphRegions, NameDerivedDims, NarrowIndices,
                              ProgrammaticDependentLaunch,
                              SliceIntoConvPadding,
                              SplitAsSlices, StoreWeightsTransposed, gpu_legalize_passes,
                              numerics_legalize_map)
from grape_tvm.passes.conv_matmul import Conv1dAsMatmul
from grape_tvm.passes.few_rows_gemv import GemvForFewRows
from grape_tvm.passes.fused_scalars import before_fuse_tir
from grape_tvm.passes.library_matmul import OffloadMatmul
from grape_tvm.runtime.signature import ShapeRange


def _finalize_passes(device_branches: bool = True) -> list[tvm.transform.Pass]:
    # TVM's finalize passes for every target, with RewriteCUDAGraph replaced by
    # LiftGraphRegions: TVM's pass only captures static regions.
    t = relax.transform
    # Branches on device data: conditional regions, guarded on the device (or left to
    # the VM, which reads the condition on the host: the baseline they are measured against).
    branches = [BranchesToConditionalRegions()] if device_branches else []
    return [
        t.StaticPlanBlockMemory(),
        # TVM's planner can share a storage across an if without defining it in every
        # branch that uses it (passes/branch_storage.py): defined before the if instead.
        HoistBranchStorage(),
        *branches,
        LiftGraphRegions(),
        DescribeConditionals(),
        t.LowerAllocTensor(),
        t.KillAfterLastUse(),
        # While storages, views and region calls are plain bindings: what a call does, for
        # a runtime that runs it without TVM's VM.
        DescribeCallProgram(),
        t.LowerRuntimeBuiltin(),
        t.ComputePrimValue(),
        t.VMShapeLower(),
        t.AttachGlobalSymbol(),
    ]


def is_gpu(target: tvm.target.Target) -> bool:
    return "gpu" in target.keys


def _backend(target: tvm.target.Target):
    # The per-target pipeline modules themselves: relax.pipeline.dataflow_lower_passes fails
    # for llvm in TVM 0.27 (cpu_generic's package does not export it).
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm.relax.backend.cuda import pipeline as cuda
    from tvm.relax.backend.gpu_generic import pipeline as gpu

    if target.kind.name == "cuda":
        return cuda
    if target.kind.name in ("llvm", "c"):
        return cpu
    if is_gpu(target):
        return gpu
    raise ValueError(f"grape-tvm has no lowering for target kind {target.kind.name!r}; "
                     "use llvm or cuda")


@module_pass(opt_level=0, name="GrapePipeline")
class GrapePipeline:
    """Lower a Relax module for grape: bound shapes, branches to selects, TVM's per-target
    lowering, regions.

    ``dims`` may be omitted when the functions already carry ``tir_var_upper_bound``. The
    target is the one given or, as with TVM's own pipelines, the one in scope.
    """

    def __init__(self, target: tvm.target.Target | None = None,
                 dims: Mapping[str, ShapeRange | tuple[int, int]] | None = None,
                 select_ops: int = 16, device_branches: bool = True,
                 matmul: str | None = None, weights: Sequence[int] = (),
                 dependent_launch: bool = True):
        self.target = target
        self.dependent_launch = dependent_launch
        self.dims = dict(dims or {})
        self.select_ops = select_ops
        self.device_branches = device_branches
        self.matmul = matmul
        self.weights = tuple(weights)

    def transform_module(self, mod: tvm.IRModule, ctx: PassContext) -> tvm.IRModule:
        target = self.target or tvm.target.Target.current(allow_none=False)
        lowering = _backend(target)
        with target:
            # Shapes an importer computed in tensors, back to expressions of the dims.
            passes = [FoldShapeTensors()]
            if self.dims:
                passes.append(BoundShapeRanges(self.dims))
            # A rank's all-reduces inside its graphs (NCCL's), not host steps between them.
            passes.append(CollectivesAsLibraryCalls())
            # A conv trimmed by a slice ("same" padding, even kernel): less padding instead,
            # else the fused kernel's GPU schedule needs a symbolic-size shared buffer.
            passes.append(SliceIntoConvPadding())
            matmul = matmul_implementation(target, self.matmul)
            if matmul in ("auto", "cublaslt"):
                # A conv1d as a gather of its windows and a matmul (OffloadMatmul's, below);
                # before NameDerivedDims, which names the dims of the new tensors too.
                passes.append(Conv1dAsMatmul())
            if is_gpu(target):
                # A dim computed with a division defeats the GPU schedules: name it.
                passes.append(NameDerivedDims())
            # Branches cheap enough to run both: no host read of the condition, and the
            # dataflow blocks (hence fusion) that an ``if`` from the ONNX importer removed.
            if self.select_ops > 0:
                passes += [IfToSelect(self.select_ops), relax.transform.Normalize()]
            if self.device_branches:
                # A branch passing a value through copies it: a conditional region needs
                # each branch to write its result.
                passes.append(CopyPassThroughBranches())
            # Branches left get dataflow blocks too; outlined, FuseOps fuses them.
            passes += [relax.transform.ConvertToDataflow(), OutlineBranches()]
            # A split read part by part: a slice per part, fused with its readers.
            passes.append(SplitAsSlices())
            # Weights stored [N, K], the GEMV kernels' faster layout: constants copied once
            # here (GPU), inputs bound once (``weights``) transposed as they are bound (on
            # every target: read in place on the CPU too).
            transposed_constants = is_gpu(target) and matmul != "tvm"
            if transposed_constants or self.weights:
                passes.append(StoreWeightsTransposed(self.weights, transposed_constants))
            if target.kind.name == "cuda" and matmul != "tvm":
                # Attention as one kernel of grape's runtime, 16-bit or a decode step's
                # (before OffloadMatmul takes its two products).
                passes.append(FuseAttention())
            if matmul in ("auto", "cublaslt"):
                passes.append(OffloadMatmul())
            passes += lowering.library_dispatch_passes(target)
            decode_gemv = matmul != "tvm"  # the matmuls left to schedules: grape's rules first
            if (is_gpu(target) and decode_gemv) or self.weights:
                # An nn.Linear weight's transpose read in place by the matmul kernel (GEMV "nk"),
                # and a bound weight taken transposed (on every target).
                passes.append(FuseWeightTranspose())
            # NaN and empty reductions as onnxruntime has them (passes/numerics.py).
            numerics = numerics_legalize_map(gpu=is_gpu(target))
            if is_gpu(target):
                # TVM's GPU legalization, with schedule rules that pass a kernel on when
                # they fail on it (passes/gpu_schedules.py).
                # Few rows: grape's GEMV kernels, not the library's, with a row norm before
                # them and an activation after them fused (both still as legalized).
                few_rows = (GemvForFewRows(),) if matmul == "auto" else ()
                passes += gpu_legalize_passes(numerics, decode_gemv, few_rows)
                passes.append(CheckDeviceKernels())
                # 32-bit index arithmetic where the declared ranges allow it: kernels over
                # symbolic dims spend their instructions on 64-bit indices otherwise.
                passes.append(NarrowIndices())
            else:
                for p in lowering.legalize_passes(target):
                    passes.append(relax.transform.LegalizeOps(numerics)
                                  if p.info.name == "LegalizeOps" else p)
                    if p.info.name == "AnnotateTIROpPattern":  # as gpu_legalize_passes
                        passes += [FuseGathers(), FuseIntoConcatenations(),
                                   FuseIntoInplaceWrites()]
                # An empty reduction's output gets its identity (passes/reduction_init.py;
                # dlight schedules GPU reductions itself).
                passes.append(HoistReductionInit())
            passes.append(InlineBranches())
            lower = lowering.dataflow_lower_passes(target)
            if is_gpu(target) and self.dependent_launch:
                # Each kernel launched while the one before it ends (sm_90 and up); after
                # RewriteDataflowReshape, which finds reshapes by their PrimFuncs' bodies
                # (a view then, not a kernel).
                names = [p.info.name for p in lower]
                if "RewriteDataflowReshape" not in names:
                    raise RuntimeError("TVM's dataflow lowering has no RewriteDataflowReshape: "
                                       "ProgrammaticDependentLaunch must follow it")
                lower.insert(names.index("RewriteDataflowReshape") + 1,
                             ProgrammaticDependentLaunch(target, self.weights))
            passes += lower + _finalize_passes(self.device_branches)
            # A fused function taking a scalar and a shape: its scalars as dims, else TVM's
            # FuseTIR fails on it (passes/fused_scalars.py).
            return tvm.transform.Sequential(before_fuse_tir(passes))(mod)


def matmul_implementation(target: tvm.target.Target, asked: str | None) -> str:
    """What runs a model's matmuls: ``asked``, or by default ("auto") grape's GEMV kernels
    for few rows and cuBLASLt above on CUDA, TVM's schedules elsewhere. On the H200, GPT-2's
    matmuls at M = 1 to 512, fp32 and fp16 (bench/results/matmul.json): cuBLASLt in grape's
    graphs takes 0.97x to 1.03x torch.matmul's (cuBLAS) time, TVM's dlight schedules 1.6x
    to 18x cuBLASLt's, and "auto" 0.52x to 1.18x cuBLAS's (``passes/few_rows_gemv.py`` says
    which rows it gives the GEMV kernels)."""
    if asked is None:
        return "auto" if target.kind.name == "cuda" else "tvm"
    if asked not in MATMUL_IMPLEMENTATIONS:
        raise ValueError(f"matmul must be one of {MATMUL_IMPLEMENTATIONS}, got {asked!r}")
    if asked in ("auto", "cublaslt") and target.kind.name != "cuda":
        raise ValueError(f"matmul={asked!r} needs a CUDA target, not {target.kind.name}")
    return asked


def grape_pipeline(target: tvm.target.Target | None = None,
                   dims: Mapping[str, ShapeRange | tuple[int, int]] | None = None,
                   select_ops: int = 16, device_branches: bool = True,
                   matmul: str | None = None, weights: Sequence[int] = (),
                   dependent_launch: bool = True) -> tvm.transform.Pass:
    """The pass ``tvm.compile(mod, target, relax_pipeline=grape_pipeline(...),
    tir_pipeline="grape")`` takes (``grape_tir_pipeline``: the kernel attributes the GEMVs
    holding their weights across the wait need, coherent loads and launch bounds).

    ``select_ops``: branches of at most this many operators become selects (``IfToSelect``);
    0 keeps every ``if``. ``matmul``: "auto" (CUDA's default: "cublaslt", with grape's GEMV
    kernels where the rows are few, ``passes/few_rows_gemv.py``), "cublaslt" (matmuls with
    a weight become cuBLASLt calls captured in the graphs, at every M), "grape" (grape's
    GEMV kernels for matmuls with few rows, ``passes/gemv_schedule.py``, a transposed 2-D
    weight read in place, ``FuseWeightTranspose``; dlight above them) or "tvm" (dlight's
    rules alone, a transpose kernel; the default elsewhere). Under "auto" and "cublaslt" the
    matmuls the library does not take get grape's rules.
    ``device_branches``: the ``if``s left become conditional regions (no host read of the
    condition); False leaves them to the VM, which reads it. ``weights``: positions of
    ``main``'s parameters the caller binds once (``bind_inputs``); a [K, N] matmul weight
    among them is taken [N, K] (``StoreWeightsTransposed``) and transposed as it is bound.
    ``dependent_launch``: on CUDA sm_90 and up, every kernel launched while the one before
    it ends (``ProgrammaticDependentLaunch``).
    """
    return GrapePipeline(target, dims, select_ops, device_branches, matmul, weights,
                         dependent_launch)


TIR_PIPELINE = "grape"


def grape_tir_pipeline():
    """TVM's default TIR pipeline, with ``KernelAttributes`` first among the passes that
    finish the device kernels: ``tvm.compile(mod, target, relax_pipeline="grape",
    tir_pipeline="grape")``. (TVM's own TIR pipeline builds grape's kernels too, without
    the attributes ``ProgrammaticDependentLaunch`` asks for some: those GEMVs then load
    their weights after the wait.)"""
    lower, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("default")

    def finalize_kernels():
        return tvm.ir.transform.Sequential([KernelAttributes(), finalize_device()])

    return lower, finalize_host, finalize_kernels


if "grape" not in relax.pipeline.PIPELINE_MAP:
    # tvm.compile(mod, target, relax_pipeline="grape") looks pipelines up by name.
    relax.register_pipeline("grape")(grape_pipeline)
if TIR_PIPELINE not in tvm.tirx.compilation_pipeline.PIPELINE_MAP:
    tvm.tirx.register_tir_pipeline(TIR_PIPELINE, grape_tir_pipeline)
