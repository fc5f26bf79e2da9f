"""TVM's default GPU schedules (dlight), with a rule that fails on a kernel passing it on,
and, where the declared ranges say a dim is small, a decode-shaped matrix-vector rule first."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.schedule.schedule import ScheduleError

SMALL_BATCH = 16  # a symbolic dim declared at most this large is a batch for SmallBatchGEMV


class TolerantRule(ScheduleRule):
    """A dlight rule whose ``ScheduleError`` means "not mine": the next rule is tried.

    dlight's ``ApplyDefaultSchedule`` tries its rules in order and moves on when one
    returns ``None``; a rule that accepts a kernel and then fails on a schedule primitive
    aborts the whole build instead. In TVM 0.27 ``GeneralReduction`` does that on GPT-2's
    decode attention (``q @ k^T`` over ``past + 1`` keys fused with the scale and mask add:
    "'bind' ... neither a local complete block nor a local reduction block").
    """

    def __init__(self, rule: ScheduleRule):
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except ScheduleError:
            return None

    def __repr__(self) -> str:
        return f"TolerantRule({type(self.rule).__name__})"


class SmallBatchGEMV(ScheduleRule):
    """dlight's ``LowBatchGEMV`` for kernels whose every symbolic dim is declared small.

    A decode step's matmuls are matrix-vector products over a symbolic batch: for
    ``(batch, 1, 768) @ (768, 3072)`` TVM's rule order picks ``Matmul`` (a GEMM tiling) and
    the kernel runs at a few percent of memory bandwidth (GPT-2's MLP projection: 192 us
    against 60 us for the others, ``bench/kernel_profile.py``). ``LowBatchGEMV`` (MLC-LLM's
    decode rule: batch padded to a bucket, one thread group per output) fits it, but only
    while the batch is small: grape knows the declared ranges, TVM's default rules do not.

    Before: ``fused_matmul5_add6`` scheduled by ``Matmul`` (batch in 1..8).
    After: the same kernel scheduled by ``LowBatchGEMV(4)``; with ``batch`` in 1..1024, or a
    symbolic ``past``, the rule declines and TVM's order applies.
    """

    def __init__(self, small_dims: Iterable[str], bucket: int = 4):
        self.small_dims = frozenset(small_dims)
        self.rule = dl.gpu.LowBatchGEMV(bucket)

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, tunable: bool):
        dims = _symbolic_dims(func)
        if not dims or not dims <= self.small_dims:
            return None
        try:
            return self.rule.apply(func, target, tunable)
        except (ScheduleError, AssertionError):  # the rule asserts on shapes it cannot take
            return None

    def __repr__(self) -> str:
        return f"SmallBatchGEMV({sorted(self.small_dims)})"


def _symbolic_dims(func: tirx.PrimFunc) -> set[str]:
    """Names of the symbolic vars in the extents of the kernel's block iterators."""
    from tvm import s_tir  # pylint: disable=import-outside-toplevel
    from tvm.s_tir.dlight.analysis import normalize_prim_func  # pylint: disable=import-outside-toplevel

    infos = normalize_prim_func(s_tir.Schedule(func))
    names = set()
    for info in infos or ():
        for it in info.iters:
            if not isinstance(it.dom, int) and not isinstance(it.dom, tirx.IntImm):
                names.update(v.name for v in tirx.analysis.undefined_vars(it.dom))
    return names


def small_dims(dims: Mapping[str, Any], limit: int = SMALL_BATCH) -> list[str]:
    """Names of the declared dims whose upper bound is at most ``limit``."""
    return [name for name, rng in dims.items() if _hi(rng) <= limit]


def _hi(rng: Any) -> int:
    return int(rng.hi) if hasattr(rng, "hi") else int(rng[1])


def default_gpu_rules() -> list[ScheduleRule]:
    """TVM's CUDA rules in TVM's order, each ``TolerantRule``; ``Fallback`` last binds
    whatever the others left."""
    return [TolerantRule(rule) for rule in (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                            dl.gpu.GeneralReduction())] + [dl.gpu.Fallback()]


def gpu_legalize_passes(dims: Mapping[str, Any] | None = None) -> list[tvm.transform.Pass]:
    """``tvm.relax.backend.cuda.pipeline.legalize_passes`` with tolerant schedule rules;
    with declared ``dims``, matrix-vector kernels over small dims first (``SmallBatchGEMV``)."""
    from .name_derived_dims import keep_renaming_reshape  # pylint: disable=import-outside-toplevel

    t = relax.transform
    # A reshape that only names a derived dim (NameDerivedDims) stays a view.
    return [t.LegalizeOps({"relax.reshape": keep_renaming_reshape}), t.AnnotateTIROpPattern(),
            t.FoldConstant(), t.FuseOps(),
            t.FuseTIR(), dl.ApplyDefaultSchedule(*_rules(dims))]


def _rules(dims: Mapping[str, Any] | None) -> list[ScheduleRule]:
    small = small_dims(dims or {})
    return ([SmallBatchGEMV(small)] if small else []) + default_gpu_rules()
