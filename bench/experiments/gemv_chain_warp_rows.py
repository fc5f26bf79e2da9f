"""``build/gpu/gemv_chain/warp_rows/``: the chains of ``bench/gemv_chain.py`` with the one-row
GEMV kernels for [N, K] weights tiled as ``bench/kernels/pdl_chain.cu``'s are, a warp along K
per row of w and four rows a block, every weight of a thread (up to 384 bytes) held before
the wait. Tried in the session of 2026-12-03, sixth part (bench/README.md): not adopted.

    python3 bench/experiments/gemv_chain_warp_rows.py   # from the checkout, after gemv_chain
"""

import sys
from pathlib import Path

sys.path[:0] = ["bench/gpu", "bench"]
import build_artifacts  # noqa: E402  pylint: disable=wrong-import-position
from grape_tvm.passes import few_rows_gemv, gemv_schedule  # noqa: E402  pylint: disable=wrong-import-position
from grape_tvm.passes.gemv_schedule import GemvConfig  # noqa: E402  pylint: disable=wrong-import-position

default_config = gemv_schedule.gemv_config


def warp_rows(shape, bucket):
    config = default_config(shape, bucket)
    if shape.layout != "nk" or bucket != 1 or (shape.k // config.vec) % 32:
        return config
    steps = shape.k // (32 * config.vec)
    unroll = next(u for u in (4, 3, 2, 1) if steps % u == 0)
    return GemvConfig(1, config.vec, 32, 4, 1, unroll)


gemv_schedule.gemv_config = few_rows_gemv.gemv_config = warp_rows
gemv_schedule.WEIGHT_REGISTER_BYTES = 384
build_artifacts.CHAIN_BUILDS = {"warp_rows": (True, None)}
build_artifacts.build_gemv_chains(Path("build/gpu"))
