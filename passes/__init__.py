"""grape-tvm's Relax and TIR passes.

Each pass does one job and composes with ``tvm.transform.Sequential``:

- ``BoundShapeRanges``: declared dimension ranges become ``tir_var_upper_bound``.
- ``LiftGraphRegions``: runs of kernel launches become region functions; the rest stays on
  the host. ``graph_plan`` reads the result back for ``inspect``.
- ``CheckDeviceKernels``: a GPU build with a kernel left on the host is an error.
- ``IfToSelect``: cheap, pure branches on a tensor condition become selects (no host read).
- ``BranchesToConditionalRegions``: other branches on device data become conditional
  regions (both branches run guarded by the condition on the device);
  ``DescribeConditionals`` writes down what their branches call, for the runtime;
  ``CopyPassThroughBranches`` makes a branch that passes a value through copy it first.
- ``OutlineBranches`` / ``InlineBranches``: branches moved into functions of their own for
  ``FuseOps`` (which does not look inside an ``if``), and back after fusion.
- ``HoistBranchStorage``: a storage TVM's memory planner shares across an ``if`` is defined
  before it (a TVM 0.27 planner bug, else the VM reads an undefined storage);
  ``after_memory_planning`` puts it after ``StaticPlanBlockMemory`` in a pass list.
- ``gpu_legalize_passes``: TVM's GPU legalization with ``TolerantRule`` schedule rules
  (a rule failing on a kernel passes it to the next) and grape's rules: ``FullReduction``
  for reductions to one element (one thread block, an all-reduce over its threads),
  ``RowReductionPerWarp`` for row reductions over a sequence's rows (softmax, layer
  norm: a warp per row), ``RowsOfStaticWidth`` and ``RowsOfSymbolicWidth`` for element-wise
  kernels over a symbolic number of rows (no per-element division by a symbolic extent);
  before fusion, ``FuseIntoRowReductions`` lets a softmax or layer norm take its
  element-wise producers (attention's scale and mask), ``FuseIntoConcatenations`` a
  concatenation its injective ones (a decode step's new key and value rows),
  ``FuseGathers`` a gather (``take``: an embedding lookup) its element-wise neighbours;
  ``FuseIntoInplaceWrites`` an in-place write (``call_tir_inplace``) the slices and
  reshapes it writes from (a static cache's new rows).
- ``DecodeGemv``: a schedule rule for matmuls with few rows (decode): GEMV kernels with
  their epilogue fused, by buckets of M, chosen on the host; dlight's Matmul above them.
  ``FuseWeightTranspose``: a matmul by a transposed 2-D weight reads it in place (GPU);
  ``StoreWeightsTransposed``: a matmul weight stored [K, N] is stored [N, K]: a constant
  (GPU), an input bound once (``build(weights=...)``; transposed as it is bound).
- ``LowerTensorParallel``: a model annotated with sharding placements to the program each
  rank runs (TVM's ``relax.distributed``; ``build(tensor_parallel=N)``), its matmuls, adds
  and GELUs made Relax ops again (``RaiseLegalizedOps``); ``LocalParams``: each
  rank's part of a weight as its parameter, not scattered on every call;
  ``CollectivesAsLibraryCalls``: its all-reduces calls of grape's NCCL library, kernels of
  its graph regions.
- ``ShardMegatron``: an imported decoder's ``main`` annotated for N devices Megatron's way,
  found from its dataflow (attention by heads, the MLP by its inner dim; a fused qkv split
  by ranks); ``InputForVarlessCalls``: its position computations made kernels the
  sharding propagation can place (``compile_onnx(tensor_parallel=N)``).
- ``NarrowIndices``: 32-bit indices in GPU kernels whose buffers stay below 2^31 elements.
- ``ProgrammaticDependentLaunch``: every GPU kernel launched while the one before it ends
  (sm_90+), a GEMV's weights loaded before it waits for that kernel; ``KernelAttributes``
  (grape's TIR pipeline, on the device kernels) gives such a kernel the attributes the pass
  marked it with (coherent loads, a minimum of blocks an SM).
- ``FuseAttention``: 16-bit ``softmax(q k^T * scale + bias) v`` as one call of grape's fused
  attention kernel (q, k, v read in place from a qkv product, a causal mask as its causal
  mode; CUDA); a decode step's (a few query rows, fp32 too) as one call of its decode
  attention kernel, which also appends the step's keys and values to the cache where k and
  v are ``concat(past, new)``.
- ``Conv1dAsMatmul``: a conv1d becomes a gather of its windows and a matmul (im2col),
  batched over its groups, for ``OffloadMatmul`` to give to cuBLASLt (CUDA).
- ``GemvForFewRows``: a cuBLASLt matmul (``OffloadMatmul``) whose rows are few runs on
  ``DecodeGemv``'s kernels, cuBLASLt above, one PrimFunc choosing on the host (CUDA); an
  element-wise kernel of one input after it (an erf GELU) and a row norm before it (a
  layer norm, computed by the one-row kernel itself) join that PrimFunc.
- ``NameDerivedDims``: a dimension computed with a division gets its own variable (GPU).
- ``numerics_legalize_map``: legalizations that keep NaN through relu, clip, maximum,
  minimum and sign, and give empty max/min/mean reductions onnxruntime's values;
  ``HoistReductionInit``: a reduction's init before its loops, so that an empty one
  returns its identity (CPU).
- ``FoldShapeTensors``: dims read from a small integer tensor whose elements are known
  expressions of dims (an importer's shape arithmetic) become those expressions.
- ``SliceIntoConvPadding``: a slice dropping a conv's last outputs becomes less padding.
- ``SplitAsSlices``: a split read part by part becomes a slice per part (a reshape of a
  part into heads, a slice of heads), which fuses with its readers (attention's q, k, v).
- ``FusedScalarsAsDims``: a fused function's integer scalar parameters become dims of its
  shape parameter, before ``FuseTIR`` (which fails on a function taking both).

Passes touch IR only: nothing here launches a kernel or owns a device resource.
"""

from .bound_shapes import BoundShapeRanges, signature_dims
from .branch_copy import CopyPassThroughBranches
from .branch_fusion import InlineBranches, OutlineBranches
from .branch_regions import BranchesToConditionalRegions, DescribeConditionals
from .branch_storage import HoistBranchStorage, after_memory_planning
from .concat_fusion import FuseIntoConcatenations
from .gather_fusion import FuseGathers
from .inplace_fusion import FuseIntoInplaceWrites
from .conv_matmul import Conv1dAsMatmul
from .conv_slice import SliceIntoConvPadding
from .fused_scalars import FusedScalarsAsDims
from .check_kernels import CheckDeviceKernels, HostFallbackError, unbound_kernels
from .gemv_schedule import DecodeGemv
from .tensor_parallel import CollectivesAsLibraryCalls, LocalParams, LowerTensorParallel
from .megatron import InputForVarlessCalls, MegatronError, ShardMegatron
from .fused_attention import FuseAttention
from .narrow_indices import NarrowIndices
from .dependent_launch import ProgrammaticDependentLaunch
from .kernel_attributes import KernelAttributes
from .weight_transpose import FuseWeightTranspose, StoreWeightsTransposed
from .gpu_schedules import TolerantRule, default_gpu_rules, gpu_legalize_passes
from .if_to_select import IfToSelect
from .name_derived_dims import NameDerivedDims
from .numerics import numerics_legalize_map
from .reduction_init import HoistReductionInit
from .reduction_schedules import FullReduction
from .row_reduction_fusion import FuseIntoRowReductions
from .shape_tensors import FoldShapeTensors
from .split_slices import SplitAsSlices
from .call_program import DescribeCallProgram
from .lift_regions import GraphPlan, LiftGraphRegions, graph_plan
# Names the passes and the runtime share, defined once in the runtime's call program format.
from grape_tvm.runtime.call_program import (CONDITIONAL_ATTR, CONDITIONAL_PREFIX, REGION_ATTR,
                                            REGION_PREFIX)

__all__ = [
    "BoundShapeRanges",
    "BranchesToConditionalRegions",
    "CONDITIONAL_ATTR",
    "CONDITIONAL_PREFIX",
    "CheckDeviceKernels",
    "Conv1dAsMatmul",
    "CopyPassThroughBranches",
    "DecodeGemv",
    "DescribeCallProgram",
    "DescribeConditionals",
    "FoldShapeTensors",
    "FullReduction",
    "FuseGathers",
    "FuseIntoConcatenations",
    "FuseIntoInplaceWrites",
    "FuseIntoRowReductions",
    "FuseWeightTranspose",
    "StoreWeightsTransposed",
    "LocalParams",
    "LowerTensorParallel",
    "CollectivesAsLibraryCalls",
    "InputForVarlessCalls",
    "MegatronError",
    "ShardMegatron",
    "FuseAttention",
    "NarrowIndices",
    "ProgrammaticDependentLaunch",
    "KernelAttributes",
    "FusedScalarsAsDims",
    "GraphPlan",
    "HoistBranchStorage",
    "HoistReductionInit",
    "HostFallbackError",
    "IfToSelect",
    "InlineBranches",
    "LiftGraphRegions",
    "NameDerivedDims",
    "OutlineBranches",
    "REGION_ATTR",
    "REGION_PREFIX",
    "SliceIntoConvPadding",
    "SplitAsSlices",
    "TolerantRule",
    "after_memory_planning",
    "default_gpu_rules",
    "gpu_legalize_passes",
    "graph_plan",
    "numerics_legalize_map",
    "signature_dims",
    "unbound_kernels",
]
