"""Which GPU run each kernel of the row rules' final code was measured in (the question of
the session of 2026-12-01, fifth; that code has since run on the H200 itself, with the
changes after it: bench/README.md, session of 2026-12-02, first lease).

The final form of the row rules (``RowReductionPerWarp`` and ``RowsOfSymbolicWidth`` on the
rows of a sequence only, reductions checked to be one element of a row) was not run on the
GPU: the session's device time was spent. Two forms were: the code of dee4d5c (no row
rules; ``gpu_run/run.wide_rows.log``) and the row rules on any symbolic rows, the
reductions unchecked (``gpu_run/run.row_rules_unrestricted.log``). This builds, for CUDA and
without nvcc where it can, GPT-2's prefill and decode step (fp32, fp16), Wav2Vec2 and the
GPU tests' artifacts under the three forms and compares each scheduled kernel's TIR, by
build step and kernel name: every kernel of the final form should equal the same kernel
in one of the two runs. Needs ``build/gpu/hf_onnx`` (``make gpu-artifacts``).

    python3 bench/row_rules_kernels.py     # writes bench/results/row_rules_kernels.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import tvm
from tvm import tirx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench" / "gpu"), str(ROOT / "bench")]

import build_artifacts  # noqa: E402  pylint: disable=wrong-import-position
import grape_tvm  # noqa: E402  pylint: disable=wrong-import-position
from grape_tvm.passes import gpu_schedules  # noqa: E402  pylint: disable=wrong-import-position
# pylint: disable=wrong-import-position
from grape_tvm.passes import row_reduction  # noqa: E402
from grape_tvm.passes.row_reduction import RowReductionPerWarp  # noqa: E402
from grape_tvm.passes.symbolic_width_schedule import RowsOfSymbolicWidth  # noqa: E402

FINAL_RULES = gpu_schedules.default_gpu_rules
FINAL_ROWS = RowReductionPerWarp.__dict__["rows_of_a_sequence"]
FINAL_WIDTH_ROWS = RowsOfSymbolicWidth.__dict__["rows_of_a_sequence"]
FINAL_IS_ONE = row_reduction._is_one  # pylint: disable=protected-access
HF_MODELS = (("gpt2_prefill", "gpt2_prefill"), ("gpt2_decode", "gpt2_decode"),
             ("gpt2_prefill_fp16", "gpt2_prefill"), ("gpt2_decode_fp16", "gpt2_decode"),
             ("wav2vec2", "wav2vec2"))


def use_form(form: str) -> None:
    """The rules as in ``form``: "final", "dee4d5c" (no row rules) or "unrestricted"."""
    gpu_schedules.default_gpu_rules = FINAL_RULES
    RowReductionPerWarp.rows_of_a_sequence = FINAL_ROWS
    RowsOfSymbolicWidth.rows_of_a_sequence = FINAL_WIDTH_ROWS
    row_reduction._is_one = FINAL_IS_ONE  # pylint: disable=protected-access
    if form == "dee4d5c":
        row_rules = (RowReductionPerWarp, RowsOfSymbolicWidth)
        gpu_schedules.default_gpu_rules = lambda *args, **kwargs: [
            r for r in FINAL_RULES(*args, **kwargs)
            if not isinstance(getattr(r, "rule", None), row_rules)]
    elif form == "unrestricted":  # as run: any symbolic rows, no check of the reductions
        RowReductionPerWarp.rows_of_a_sequence = staticmethod(
            lambda rows: any(not isinstance(e, tirx.IntImm) for e in rows))
        RowsOfSymbolicWidth.rows_of_a_sequence = staticmethod(lambda loops: len(loops) >= 1)
        row_reduction._is_one = lambda extent: True  # pylint: disable=protected-access


@tvm.instrument.pass_instrument
class ScheduledKernels:
    """Each build step's kernels as ``CheckDeviceKernels`` sees them (scheduled)."""

    def __init__(self):
        self.step = ""
        self.kernels: dict[tuple[str, str], str] = {}

    def run_after_pass(self, mod, info):
        if info.name == "CheckDeviceKernels":
            for gvar, func in mod.functions_items():
                if isinstance(func, tirx.PrimFunc):
                    self.kernels[(self.step, gvar.name_hint)] = func.script()


def build_steps(out: Path):
    onnx = ROOT / "build" / "gpu" / "hf_onnx"
    for name, dims in HF_MODELS:
        yield name, lambda n=name, d=dims: grape_tvm.compile_onnx(
            onnx / f"{n}.onnx", dims=build_artifacts.HF_DIMS[d], target=build_artifacts.CUDA,
            prebuild_cubin=False)
    for builder in build_artifacts.STEPS["tests"]:
        yield builder.__name__, lambda b=builder: b(out)


def kernels_of(form: str) -> dict[tuple[str, str], str]:
    use_form(form)
    seen = ScheduledKernels()
    with tempfile.TemporaryDirectory() as tmp, tvm.transform.PassContext(instruments=[seen]):
        for step, build in build_steps(Path(tmp)):
            seen.step = step
            build()
    print(f"{form}: {len(seen.kernels)} kernels", flush=True)
    return seen.kernels


def main() -> None:
    final, before, unrestricted = (kernels_of(f) for f in ("final", "dee4d5c", "unrestricted"))
    use_form("final")
    as_before = [k for k in final if before.get(k) == final[k]]
    as_unrestricted = [k for k in final if unrestricted.get(k) == final[k]]
    neither = [k for k in final if k not in as_before and k not in as_unrestricted]
    result = {
        "final_kernels": len(final), "same_as_dee4d5c": len(as_before),
        "same_as_unrestricted_run": len(as_unrestricted), "in_neither": [list(k) for k in neither],
        "from_unrestricted_run_only": [list(k) for k in as_unrestricted if k not in as_before],
        "from_dee4d5c_only": [list(k) for k in as_before if k not in as_unrestricted]}
    print(f"final kernels {len(final)}: as in dee4d5c {len(as_before)}, as in the unrestricted "
          f"run {len(as_unrestricted)}, in neither {len(neither)}")
    (ROOT / "bench" / "results" / "row_rules_kernels.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
