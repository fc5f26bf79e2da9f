"""TVM's default GPU schedules (dlight), with a rule that fails on a kernel passing it on."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.schedule.schedule import ScheduleError

from .injective_schedule import RowsOfStaticWidth
from .reduction_schedules import FullReduction
from .row_reduction import RowReductionPerWarp
from .concat_fusion import FuseIntoConcatenations
from .gather_fusion import FuseGathers
from .inplace_fusion import FuseIntoInplaceWrites
from .row_reduction_fusion import FuseIntoRowReductions
from .symbolic_width_schedule import RowsOfSymbolicWidth


class TolerantRule(ScheduleRule):
    """A dlight rule whose ``ScheduleError`` means "not mine": the next rule is tried.

    dlight's ``ApplyDefaultSchedule`` tries its rules in order and moves on when one
    returns ``None``; a rule that accepts a kernel and then fails on a schedule primitive
    aborts the whole build instead. In TVM 0.27 ``GeneralReduction`` does that on GPT-2's
    decode attention (``q @ k^T`` over ``past + 1`` keys fused with the scale and mask add:
    "'bind' ... neither a local complete block nor a local reduction block"). ``Reduction``
    trips an internal check in ``rfactor`` (``block_realize == old_block_realize_``) on a
    full reduction over a symbolic dim (the mean of an (n, 512) tensor): each rule works
    on its own copy of the kernel, so that is "not mine" too.
    """

    def __init__(self, rule: ScheduleRule):
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except (ScheduleError, tvm.error.InternalError):
            return None

    def __repr__(self) -> str:
        return f"TolerantRule({type(self.rule).__name__})"


class CudaCoreMatmul(ScheduleRule):
    """dlight's ``Matmul`` without its tensor-core path.

    In TVM 0.27 ``MatmulTensorization``, which ``Matmul`` takes for an fp16 matmul on
    sm_70 and later, crashes the process (a segfault in ``Tensorize``) on every fp16
    matmul tried, static or not: (1, 128, 768) x (768, 768) included, with TVM's own
    default pipeline too (docs/tvm_onnx_frontend.md). A crash cannot be caught, so the
    rule is shown a target without tensor cores (the same CUDA target, arch sm_60: it
    picks its configuration by target kind alone) and schedules the matmul on CUDA cores.
    fp32 matmuls never take that path: their schedules do not change.
    """

    def __init__(self):
        self.rule = dl.gpu.Matmul()

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, tunable: bool):
        if target.kind.name == "cuda":
            config = dict(target.export())
            config["arch"] = "sm_60"
            target = tvm.target.Target(config)
        return self.rule.apply(func, target, tunable)

    def __repr__(self) -> str:
        return "CudaCoreMatmul()"


def default_gpu_rules(decode_gemv: bool = True) -> list[ScheduleRule]:
    """grape's ``DecodeGemv`` (passes/gemv_schedule.py), then TVM's CUDA rules in TVM's
    order, each ``TolerantRule``; ``Fallback`` last binds whatever the others left.
    ``Matmul`` is ``CudaCoreMatmul``: see there. grape's ``FullReduction``
    (passes/reduction_schedules.py) comes before ``GeneralReduction``, which leaves the loops
    of a reduction to one element on the host; after ``Reduction``, whose schedules of sums
    to one element it keeps. grape's ``RowReductionPerWarp`` (passes/row_reduction.py)
    takes row reductions over the rows of a sequence before ``GeneralReduction``;
    ``RowsOfStaticWidth`` and ``RowsOfSymbolicWidth`` (passes/injective_schedule.py,
    passes/symbolic_width_schedule.py) the element-wise kernels over a symbolic number of
    rows before ``Fallback``. ``decode_gemv=False``: no ``DecodeGemv``."""
    from .gemv_schedule import DecodeGemv  # pylint: disable=import-outside-toplevel

    ours = (DecodeGemv(),) if decode_gemv else ()
    return [TolerantRule(rule) for rule in (*ours, CudaCoreMatmul(), dl.gpu.GEMV(),
                                            dl.gpu.Reduction(), FullReduction(),
                                            RowReductionPerWarp(), dl.gpu.GeneralReduction(),
                                            RowsOfStaticWidth(),
                                            RowsOfSymbolicWidth())] + \
        [dl.gpu.Fallback()]


def gpu_legalize_passes(legalize_map: dict | None = None,
                        decode_gemv: bool = True,
                        before_schedule: tuple = ()) -> list[tvm.transform.Pass]:
    """``tvm.relax.backend.cuda.pipeline.legalize_passes`` with tolerant schedule rules;
    ``legalize_map``: more legalizations of grape's (``numerics_legalize_map``);
    ``decode_gemv``: with grape's GEMV rule (``default_gpu_rules``); ``before_schedule``:
    passes between FuseTIR and the rules (they see kernels as legalized and fused)."""
    from .name_derived_dims import keep_renaming_reshape  # pylint: disable=import-outside-toplevel

    t = relax.transform
    # A reshape that only names a derived dim (NameDerivedDims) stays a view.
    legalize = {**(legalize_map or {}), "relax.reshape": keep_renaming_reshape}
    # A gather fuses with its element-wise neighbours (an embedding lookup and the add
    # after it), a softmax or layer norm takes its element-wise producers (attention's scale
    # and mask), a concatenation its injective ones (a decode step's new key and value
    # rows), an in-place write the slices and reshapes it writes from (a static cache's new
    # rows).
    return [t.LegalizeOps(legalize), t.AnnotateTIROpPattern(), FuseGathers(),
            FuseIntoRowReductions(), FuseIntoConcatenations(), FuseIntoInplaceWrites(),
            t.FoldConstant(), t.FuseOps(), t.FuseTIR(), *before_schedule,
            dl.ApplyDefaultSchedule(*default_gpu_rules(decode_gemv))]
