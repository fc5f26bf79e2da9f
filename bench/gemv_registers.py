"""Registers of grape's GEMV kernels by ``ProgrammaticDependentLaunch``'s minimum of blocks an
SM (``WEIGHTS_HELD_MIN_BLOCKS``), as ptxas reports them.

Builds one layer of GPT-2's MLP (``models.mlp_chain_relax``, fp32, weights bound once) for
sm_90 with no minimum (ptxas's default), one block and two, compiles each build's CUDA source
with ``nvcc -Xptxas -v`` and prints each GEMV kernel's registers and spills (one kernel per
bucket of rows: 1, 2, 4, 8). Holding a thread's weights in flight across the wait takes a
register per float: 48 for the MLP down projection at one row, 24 for the up projection.
With the kernels' coherent loads (no ``__restrict__``) ptxas keeps them in flight with no
minimum too (70 registers for the down projection); with ``.nc`` loads it had issued them
after the wait, in 32 (``gemv_registers.nc_loads.json``).
Runs where nvcc is (the CPU machine); writes ``gemv_registers.json``.

    python3 bench/gemv_registers.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tvm

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "gpu"), str(HERE)]

from build_artifacts import held_weights_min_blocks  # noqa: E402  pylint: disable=wrong-import-position
from models import mlp_chain_relax  # noqa: E402  pylint: disable=wrong-import-position

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
MINIMUMS = (0, 1, 2)
_PTXAS = re.compile(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores.*?"
                    r"Used (\d+) registers", re.S)


def cuda_source(min_blocks: int) -> str:
    import grape_tvm  # pylint: disable=import-outside-toplevel
    from grape_tvm.compiler import _cuda_sources  # pylint: disable=import-outside-toplevel

    mod = mlp_chain_relax(1, "float32")
    with held_weights_min_blocks(min_blocks):
        module = grape_tvm.build(mod, {"m": (1, 1024)}, CUDA, output_names=["y"],
                                 weights=[p.name for p in mod["main"].params[1:]],
                                 prebuild_cubin=False)
    return "".join(_cuda_sources(module.executable))


def registers(source: str) -> dict[str, dict[str, int]]:
    """ptxas's registers and spill stores of each GEMV kernel of ``source``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernels.cu"
        path.write_text(source)
        done = subprocess.run(["nvcc", "-arch=sm_90", "-O3", "-cubin", "-Xptxas", "-v",
                               "-o", str(path.with_suffix(".cubin")), str(path)],
                              capture_output=True, text=True, check=True)
    return {name: {"registers": int(regs), "spill_store_bytes": int(spills)}
            for name, spills, regs in _PTXAS.findall(done.stderr) if "gemv" in name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    found = {str(m): registers(cuda_source(m)) for m in MINIMUMS}
    kernels = sorted(found["0"])
    print(f"{'kernel':42s}" + "".join(f"{'min ' + m:>10s}" for m in found))
    for kernel in kernels:
        print(f"{kernel:42s}" + "".join(f"{found[m][kernel]['registers']:10d}" for m in found))
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_registers.json").write_text(json.dumps({
        "command": "python3 bench/gemv_registers.py " + " ".join(sys.argv[1:]),
        "nvcc": nvcc.strip().splitlines()[-1],
        "what": "registers and spill stores of each GEMV kernel of one GPT-2 MLP layer (fp32, "
                "sm_90), by the minimum of blocks an SM asked for (0: none)",
        "by_min_blocks": found}, indent=2))


if __name__ == "__main__":
    main()
