"""grape's decode attention kernel (runtime/kernels/decode_attention.cu) against PyTorch.

    python3 bench/decode_attention.py --cubin build/gpu/decode_attention.cubin --out OUT \
        [--variant NAME=CUBIN ...]

A decode step's attention as GPT-2's ONNX export has it after ``passes.FuseAttention``: one
query row, q a [batch, 1, heads, head_dim] view of a packed qkv, the cache k and v dense
[batch, heads, keys, head_dim], a mask (batch, 1, 1, keys) added to the scores (Hugging
Face's attention mask, zeros here), the output [batch, heads, 1, head_dim]. For each case
(dtype, head_dim, batch, keys): the largest difference from PyTorch's fp32 reference, and the
time a call takes of grape's kernel (launched by grape's runtime, ``FusedAttention``, from
the cubin given; ``splits``: the blocks it gave a row), of the unfused matmul, softmax and
matmul (what grape ran before: two cuBLAS products and a softmax kernel), and of
``F.scaled_dot_product_attention`` with the mask; and of the step appending its keys and
values to the cache as GPT-2's export has it (the new row heads of the qkv, as q; a past of
keys - 1 rows): grape's _append kernel (``grape_append_us``, the output and both presents
written) against ``torch.cat`` of each cache and SDPA (``torch_cat_sdpa_us``): ``--reps``
calls captured in one CUDA graph, replays timed by CUDA events (where K and V fit in the
L2 they stay there between calls, as in a decode step, where the cache was just written).
``bound_us``: K's and V's bytes at ``--copy-tbps`` (HBM). Prints a table, writes ``decode_attention.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run with -P too
from runtime_kernels import CubinFile, RuntimeTensor, write_results  # noqa: E402  pylint: disable=wrong-import-position
from torch_graph_timing import graph_us  # noqa: E402  pylint: disable=wrong-import-position

from grape_tvm.runtime.attention import (DECODE_SOURCE, AttentionFunction,  # noqa: E402
                                         AttentionLayout, CacheTensors, FusedAttention,
                                         ViewLayout, decode_splits)

HEADS = 12
COLUMNS = ("grape_us", "torch_unfused_us", "torch_sdpa_us", "grape_append_us",
           "torch_cat_sdpa_us")


def _view(t: torch.Tensor) -> ViewLayout:
    """A [batch, heads, rows, head_dim] view's strides, in elements."""
    return ViewLayout(0, t.stride(0), t.stride(1), t.stride(2))


class Kernel:
    """grape's runtime (``FusedAttention``) launching a build of decode_attention.cu."""

    FUNCTION = AttentionFunction(bias=True, causal=False, decode=True)
    APPEND = AttentionFunction(bias=True, causal=False, decode=True, append=True)

    def __init__(self, cubin: Path, **split):
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the primary context, current
        self.runtime = FusedAttention(CubinFile(cubin), sources=[DECODE_SOURCE], **split)

    @staticmethod
    def layout(q, k, v, mask, out) -> AttentionLayout:
        """q, out: [b, h, 1, d] views; k, v: [b, h, keys, d]; mask: [b, 1, 1, keys]."""
        batch, heads, rows, head_dim = q.shape
        bias = ViewLayout(0, mask.stride(0), 0, mask.stride(2))
        return AttentionLayout(batch, heads, rows, k.shape[2], head_dim, _view(q), _view(k),
                               _view(v), _view(out), bias)

    def splits(self, q, k, v, mask, out) -> int:
        """The blocks the runtime gives a row of this problem."""
        _, threads = self.runtime.function(self.FUNCTION, str(q.dtype).removeprefix("torch."),
                                           q.shape[-1])
        return decode_splits(self.layout(q, k, v, mask, out), threads,
                             self.runtime.split_after, self.runtime.max_splits)

    def launch(self, q, k, v, mask, out, scale: float) -> None:
        self.runtime.launch(self.FUNCTION, *(RuntimeTensor(t) for t in (q, k, v, mask, out)),
                            self.layout(q, k, v, mask, out), scale,
                            torch.cuda.current_stream().cuda_stream)

    def launch_append(self, q, cache: "Cache", mask, out, scale: float) -> None:
        """The _append kernel: attention over concat(past, new), the presents written."""
        layout = dataclasses.replace(
            self.layout(q, cache.k_present, cache.v_present, mask, out),
            k=_view(cache.k_past), v=_view(cache.v_past), past=cache.k_past.shape[2],
            **{n: _view(getattr(cache, n)) for n in AttentionLayout.APPEND_VIEWS})
        appended = CacheTensors(*(RuntimeTensor(getattr(cache, n))
                                  for n in AttentionLayout.APPEND_VIEWS))
        self.runtime.launch(self.APPEND, *(RuntimeTensor(t) for t in (
            q, cache.k_past, cache.v_past, mask, out)), layout, scale,
            torch.cuda.current_stream().cuda_stream, appended)


class Cache:
    """A decode step's caches: the past (dense, keys - 1 rows), the new row (heads of the
    qkv, as q) and the presents the step writes."""

    def __init__(self, qkv: torch.Tensor, keys: int, head_dim: int):
        batch, width = qkv.shape[0], HEADS * head_dim
        self.k_new, self.v_new = (
            qkv[..., i * width:(i + 1) * width].view(batch, 1, HEADS, head_dim).transpose(1, 2)
            for i in (1, 2))
        self.k_past, self.v_past = (torch.randn(batch, HEADS, keys - 1, head_dim,
                                                device="cuda", dtype=qkv.dtype)
                                    for _ in range(2))
        self.k_present, self.v_present = (torch.empty(batch, HEADS, keys, head_dim,
                                                      device="cuda", dtype=qkv.dtype)
                                          for _ in range(2))

    def concatenated(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.cat([self.k_past, self.k_new], dim=2),
                torch.cat([self.v_past, self.v_new], dim=2))


def run_case(kernel: Kernel, dtype, head_dim: int, batch: int, keys: int, reps: int,
             copy_tbps: float, variants: dict[str, Kernel]) -> dict:
    torch.manual_seed(keys)
    width = HEADS * head_dim
    qkv = torch.randn(batch, 1, 3 * width, device="cuda", dtype=dtype)
    q = qkv[..., :width].view(batch, 1, HEADS, head_dim).transpose(1, 2)  # [b, h, 1, d]
    k, v = (torch.randn(batch, HEADS, keys, head_dim, device="cuda", dtype=dtype)
            for _ in range(2))
    mask = torch.zeros(batch, 1, 1, keys, device="cuda", dtype=dtype)
    out = torch.empty(batch, HEADS, 1, head_dim, device="cuda", dtype=dtype)
    scale = head_dim ** -0.5
    scores = q.float() @ k.float().transpose(-1, -2) * scale + mask.float()
    want = torch.softmax(scores, dim=-1) @ v.float()

    def error(kernel_: Kernel) -> float:
        out.zero_()
        kernel_.launch(q, k, v, mask, out, scale)
        torch.cuda.synchronize()
        return (out.float() - want).abs().max().item()

    def unfused():
        return torch.softmax(q @ k.transpose(-1, -2) * scale + mask, dim=-1) @ v

    cache = Cache(qkv, keys, head_dim)
    appended_k, appended_v = cache.concatenated()
    want_appended = torch.softmax(q.float() @ appended_k.float().transpose(-1, -2) * scale +
                                  mask.float(), dim=-1) @ appended_v.float()

    def append_error(kernel_: Kernel) -> float:
        """The output's largest difference; inf if a present differs at all."""
        out.zero_()
        cache.k_present.zero_()
        cache.v_present.zero_()
        kernel_.launch_append(q, cache, mask, out, scale)
        torch.cuda.synchronize()
        if not (torch.equal(cache.k_present, appended_k) and
                torch.equal(cache.v_present, appended_v)):
            return float("inf")
        return (out.float() - want_appended).abs().max().item()

    def cat_sdpa():
        k_all, v_all = cache.concatenated()
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)

    kv_bytes = 2 * k.numel() * k.element_size()
    result = {
        "dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim, "batch": batch,
        "heads": HEADS, "keys": keys, "kv_bytes": kv_bytes,
        "bound_us": kv_bytes / (copy_tbps * 1e6), "max_abs_error": error(kernel),
        "splits": kernel.splits(q, k, v, mask, out),
        "grape_us": graph_us(lambda: kernel.launch(q, k, v, mask, out, scale), reps),
        "torch_unfused_us": graph_us(unfused, reps),
        "torch_sdpa_us": graph_us(lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale), reps),
        "append_max_abs_error": append_error(kernel),
        "grape_append_us": graph_us(lambda: kernel.launch_append(q, cache, mask, out, scale),
                                    reps),
        "torch_cat_sdpa_us": graph_us(cat_sdpa, reps),
        "variants": {}}
    for name, other in variants.items():
        result["variants"][name] = {
            "max_abs_error": error(other), "splits": other.splits(q, k, v, mask, out),
            "grape_us": graph_us(lambda o=other: o.launch(q, k, v, mask, out, scale), reps),
            "append_max_abs_error": append_error(other),
            "grape_append_us": graph_us(
                lambda o=other: o.launch_append(q, cache, mask, out, scale), reps)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cubin", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--copy-tbps", type=float, default=4.27,
                        help="device copy bandwidth, TB/s (H200: 4.27 measured)")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=CUBIN, another build (warps per block) timed beside")
    parser.add_argument("--split-after", default="1,4",
                        help="other split policies timed beside: keys a thread after which a "
                             "row's keys split (the runtime's: SPLIT_AFTER)")
    args = parser.parse_args()
    kernel = Kernel(args.cubin)
    variants = {"no_split": Kernel(args.cubin, max_splits=1),
                "no_wide": Kernel(args.cubin, wide_dtypes=())}
    for after in (int(r) for r in args.split_after.split(",") if r):
        variants[f"split_after{after}"] = Kernel(args.cubin, split_after=after)
    for spec in args.variant:
        name, path = spec.split("=", 1)
        variants[name] = Kernel(Path(path))
    cases = [(dtype, 64, batch, keys) for dtype in (torch.float32, torch.float16)
             for batch in (1, 8) for keys in (2, 65, 257, 513, 1024)]
    cases += [(torch.float16, 128, 1, 1024), (torch.bfloat16, 64, 1, 257)]
    print(f"{'dtype':9} {'d':>4} {'b':>2} {'keys':>5} {'split':>5} {'err':>8} {'bound':>7} "
          + " ".join(f"{c[:-3]:>13}" for c in COLUMNS) + "  (us)")
    results = []
    started = time.time()
    for case in cases:
        r = run_case(kernel, *case, reps=args.reps, copy_tbps=args.copy_tbps, variants=variants)
        results.append(r)
        print(f"{r['dtype']:9} {r['head_dim']:4} {r['batch']:2} {r['keys']:5} {r['splits']:5} "
              f"{r['max_abs_error']:8.1e} {r['bound_us']:7.2f} "
              + " ".join(f"{r[c]:13.2f}" for c in COLUMNS) + "".join(
                  f"  {n} {x['grape_us']:.2f}/{x['splits']} ({x['max_abs_error']:.0e}) "
                  f"append {x['grape_append_us']:.2f} ({x['append_max_abs_error']:.0e})"
                  for n, x in r["variants"].items()), flush=True)
    write_results(args.out, "decode_attention.json", started,
                  what="us per call: reps calls in one CUDA graph, 5 replays timed by CUDA "
                       "events (K and V left in L2 between calls where they fit); "
                       "max_abs_error against PyTorch's fp32 softmax(q k^T * scale + mask) v; "
                       "bound_us: K and V bytes at copy_tbps; torch_unfused: matmul, softmax, "
                       "matmul; torch_sdpa: F.scaled_dot_product_attention with the mask; "
                       "grape_append: the _append kernel over a past of keys - 1 rows and "
                       "the new row (the presents written; append_max_abs_error inf if one "
                       "differs); torch_cat_sdpa: torch.cat of each cache, then SDPA; "
                       "variants: no_split (a block a row), no_wide (no _wide kernel: 8 warps "
                       "a block always), split_afterN (rows of more than N "
                       "keys a thread split, a key a thread a block), wN (builds of N warps a "
                       "block)",
                  reps=args.reps, copy_tbps=args.copy_tbps, cases=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
