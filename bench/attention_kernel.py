"""grape's fused attention kernel (runtime/kernels/attention.cu) against PyTorch, side by side.

    python3 bench/attention_kernel.py --cubin build/gpu/attention.cubin --out OUT \
        [--variant NAME=CUBIN ...]

For each case (dtype, head dim, batch, heads, sequence length; a causal bias as GPT-2's ONNX
export computes it, -65504 above the diagonal; q, k and v read in place from a packed
[batch, seq, 3 * heads * head_dim] tensor and the output written [batch, seq, heads,
head_dim], as in a GPT-2 layer): the largest difference from PyTorch's fp32 reference
(softmax(q k^T * scale + bias) v), and the time a call of grape's kernel (its causal mode,
and reading the bias), of ``F.scaled_dot_product_attention`` with the same bias
(``attn_mask``) and with ``is_causal`` (FlashAttention), and of the unfused matmul, softmax
and matmul takes: ``--reps`` calls captured in a CUDA graph, replays timed by CUDA events.
grape's kernel is launched by grape's runtime (``runtime/attention.py``'s ``FusedAttention``,
as a model's call is), from the cubin given. Prints a table, writes ``attention_kernel.json``.
Needs torch, cuda-python and grape-tvm's runtime on a GPU host.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run with -P too
from runtime_kernels import CubinFile, RuntimeTensor, write_results  # noqa: E402  pylint: disable=wrong-import-position
from torch_graph_timing import graph_us  # noqa: E402  pylint: disable=wrong-import-position

from grape_tvm.runtime.attention import (SOURCE, AttentionFunction,  # noqa: E402
                                         AttentionLayout, FusedAttention, ViewLayout)


def _view(t: torch.Tensor) -> ViewLayout:
    """A [batch, rows, heads, head_dim] view's strides (a dim of 1 broadcast: stride 0)."""
    batch, rows, heads = (0 if t.shape[i] == 1 else t.stride(i) for i in range(3))
    return ViewLayout(0, batch, heads, rows)


class Kernel:
    """grape's runtime (``FusedAttention``) launching a build of attention.cu."""

    def __init__(self, cubin: Path):
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the primary context, current
        self.runtime = FusedAttention(CubinFile(cubin), sources=[SOURCE])

    def launch(self, q, k, v, bias, out, scale: float, causal: bool) -> None:
        """q, k, v, out: [batch, rows, heads, head_dim] views; bias [b, h, rows, keys] or
        None."""
        batch, rows, heads, head_dim = q.shape
        bias_view = ViewLayout(0, 0, 0, 0) if bias is None else _view(bias.transpose(1, 2))
        layout = AttentionLayout(batch, heads, rows, k.shape[1], head_dim, _view(q), _view(k),
                                 _view(v), _view(out), bias_view)
        self.runtime.launch(AttentionFunction(bias=bias is not None, causal=causal),
                            *(RuntimeTensor(t) for t in (q, k, v)),
                            None if bias is None else RuntimeTensor(bias), RuntimeTensor(out),
                            layout, scale, torch.cuda.current_stream().cuda_stream)


def causal_bias(batch: int, rows: int, dtype) -> torch.Tensor:
    i = torch.arange(rows, device="cuda")
    allowed = i[None, :] <= i[:, None]
    bias = torch.where(allowed, 0.0, -65504.0).to(dtype)
    return bias[None, None].expand(batch, 1, rows, rows).contiguous()


def reference(q, k, v, bias, scale):
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    scores = qf @ kf.transpose(-1, -2) * scale + bias.float()
    return (torch.softmax(scores, dim=-1) @ vf).transpose(1, 2)  # [b, s, h, d]


def run_case(kernel: Kernel, dtype, head_dim: int, batch: int, heads: int, rows: int,
             reps: int, variants: dict[str, Kernel]) -> dict:
    torch.manual_seed(rows)
    width = heads * head_dim
    qkv = torch.randn(batch, rows, 3 * width, device="cuda", dtype=dtype)
    q, k, v = (qkv[..., i * width:(i + 1) * width].view(batch, rows, heads, head_dim)
               for i in range(3))
    bias = causal_bias(batch, rows, dtype)
    out = torch.empty(batch, rows, heads, head_dim, device="cuda", dtype=dtype)
    scale = head_dim ** -0.5
    want = reference(q, k, v, bias, scale)
    errors = {}
    for causal in (True, False):
        out.zero_()
        kernel.launch(q, k, v, None if causal else bias, out, scale, causal)
        torch.cuda.synchronize()
        errors[causal] = (out.float() - want).abs().max().item()
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def unfused():
        scores = qt @ kt.transpose(-1, -2) * scale + bias
        return torch.softmax(scores, dim=-1) @ vt

    return {
        "dtype": str(dtype).replace("torch.", ""), "head_dim": head_dim, "batch": batch,
        "heads": heads, "seq": rows, "max_abs_error_causal": errors[True],
        "max_abs_error_bias": errors[False],
        "grape_causal_us": graph_us(lambda: kernel.launch(q, k, v, None, out, scale, True), reps),
        "grape_bias_us": graph_us(lambda: kernel.launch(q, k, v, bias, out, scale, False), reps),
        "torch_sdpa_mask_us": graph_us(lambda: F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=bias, scale=scale), reps),
        "torch_sdpa_causal_us": graph_us(lambda: F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale), reps),
        "torch_unfused_us": graph_us(unfused, reps),
        "variants": {name: _variant(other, q, k, v, out, scale, want, reps)
                     for name, other in variants.items()},
    }


def _variant(kernel: Kernel, q, k, v, out, scale, want, reps: int) -> dict:
    """A build of the kernel with other compile-time settings: causal mode's error and time."""
    out.zero_()
    kernel.launch(q, k, v, None, out, scale, True)
    torch.cuda.synchronize()
    return {"max_abs_error_causal": (out.float() - want).abs().max().item(),
            "grape_causal_us": graph_us(
                lambda: kernel.launch(q, k, v, None, out, scale, True), reps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cubin", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=CUBIN, another build (as many rows a block) timed beside")
    args = parser.parse_args()
    kernel = Kernel(args.cubin)
    variants = {}
    for spec in args.variant:
        name, path = spec.split("=", 1)
        variants[name] = Kernel(Path(path))
    cases = [(torch.float16, 64, 1, 12, s) for s in (1, 7, 16, 100, 128, 512, 1024)]
    cases += [(torch.float16, 64, 2, 12, 300), (torch.float16, 128, 1, 16, 512),
              (torch.bfloat16, 64, 1, 12, 512), (torch.bfloat16, 128, 2, 8, 77)]
    results = []
    columns = ("grape_causal_us", "grape_bias_us", "torch_sdpa_causal_us", "torch_sdpa_mask_us",
               "torch_unfused_us")
    print(f"{'dtype':9} {'d':>4} {'b':>2} {'h':>3} {'seq':>5} {'err':>8} "
          + " ".join(f"{c[:-3]:>13}" for c in columns) + "  (us)")
    started = time.time()
    for case in cases:
        r = run_case(kernel, *case, reps=args.reps, variants=variants)
        results.append(r)
        err = max(r["max_abs_error_causal"], r["max_abs_error_bias"])
        print(f"{r['dtype']:9} {r['head_dim']:4} {r['batch']:2} {r['heads']:3} {r['seq']:5} "
              f"{err:8.1e} " + " ".join(f"{r[c]:13.1f}" for c in columns) + "".join(
                  f"  {n} {x['grape_causal_us']:.1f} ({x['max_abs_error_causal']:.0e})"
                  for n, x in r["variants"].items()), flush=True)
    write_results(args.out, "attention_kernel.json", started,
                  what="us per call: reps calls in one CUDA graph, 5 replays timed by CUDA "
                       "events; max_abs_error_* against PyTorch's fp32 softmax(q k^T * scale + "
                       "bias) v, bias causal (-65504 above the diagonal); grape_causal: the "
                       "kernel's causal mode (no bias read), grape_bias: the bias read",
                  reps=args.reps, cases=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
