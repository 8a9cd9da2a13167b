#!/usr/bin/env python3
"""PyTorch baseline for chapter 05: the MoE layer, forward + backward, with FP8 expert GEMMs.

The layer of chapter 01's torch_moe_layer.py (softmax top-k router, tokens permuted by
expert, SwiGLU experts, combine by summing), with each expert linear layer an FP8 grouped
GEMM on torch._scaled_grouped_mm, PyTorch's grouped FP8 GEMM, rowwise scales (one fp32
scale per row of each operand along the reduction):

  forward   y  = X·Wᵀ     _scaled_grouped_mm(q(X), q(W)ᵀ), X scaled per token row, W per
                          output row of each expert
  dgrad     dX = dY·W     _scaled_grouped_mm(q(dY), q(Wᵀ)ᵀ), dY per token row, Wᵀ per input
                          row (a transposed copy of each expert's weight, then quantized)
  wgrad     dW = dYᵀ·X    torch._grouped_mm in bf16 (the formula PyTorch's own autograd uses
                          for _grouped_mm)

which is the split of our FP8 layer (forward and dgrad in FP8, wgrad bf16), so the two are
compared like for like. Implementations timed:

  grouped_mm                  bf16 torch._grouped_mm (chapter 03's baseline)
  grouped_mm_compiled         the same through torch.compile
  scaled_grouped_mm           the FP8 layer above, eager
  scaled_grouped_mm_compiled  the same through torch.compile (the quantizers fuse)

Each is timed with its bf16 weight gradients added into fp32 main gradients inside the
timed step (main_grad += grad.float(), what a mixed-precision trainer needs and what our
layer's default mode writes directly). Before timing, the FP8 layer's output and input
gradient are checked against its emulation (the same FP8 codes and scales, dequantized and
multiplied per expert in fp32; relative error < 2e-2), and their distance from the bf16
layer (the recipe's quantization error) is printed.
TFLOP/s counts the expert GEMMs only, 6*T*k*3*H*F, as ch01_moe_layer_bench does.

With --ours FILE (the output of ch01_moe_layer_bench --precision bf16,fp8: its RESULT
lines), the script ends with the comparison: our FP8 and bf16 layers against these.

    python3 chapters/05-fp8-nvfp4/torch_fp8_layer.py [--shape qwen3,mixtral,qwen3-235b]
                                                     [--repeats 7] [--ours FILE]
"""
import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "01-naive-moe"))
from torch_fp8_gemm import quant_rows  # noqa: E402  (one scale per row: codes, scale_inv)
from torch_moe_layer import (SHAPES, bench, compile_layer, layer_grouped,  # noqa: E402
                             make_inputs, read_results, route)

IMPLS = ["grouped_mm", "grouped_mm_compiled", "scaled_grouped_mm", "scaled_grouped_mm_compiled"]


def quant_experts(w):
    """Rowwise FP8 of a [G, R, C] stack: codes [G, R, C], scale_inv [G, R]"""
    G, R, C = w.shape
    q, s = quant_rows(w.reshape(G * R, C))
    return q.reshape(G, R, C), s.reshape(G, R)


class Fp8GroupedLinear(torch.autograd.Function):
    """y[rows of group e] = x[rows of e] · w[e]ᵀ with FP8 forward and dgrad, bf16 wgrad"""

    @staticmethod
    def forward(ctx, x, w, offs):
        xq, sx = quant_rows(x)
        wq, sw = quant_experts(w)
        ctx.save_for_backward(x, w, offs)
        return torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), sx.reshape(-1), sw,
                                        offs=offs, out_dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dyq, sdy = quant_rows(dy)
        wtq, swt = quant_experts(w.transpose(-2, -1).contiguous())  # Wᵀ, K-major for dgrad
        dx = torch._scaled_grouped_mm(dyq, wtq.transpose(-2, -1), sdy.reshape(-1), swt,
                                      offs=offs, out_dtype=torch.bfloat16)
        dw = torch._grouped_mm(x.t(), dy, offs=offs).transpose(-2, -1)
        return dx, dw, None


def deq(q, s):
    """fp32 values of rowwise codes: q·scale_inv, the scale broadcast along the row"""
    return q.float() * s.reshape(*q.shape[:-1], 1)


class EmulatedGroupedLinear(torch.autograd.Function):
    """The reference of the check: the same quantized operands as Fp8GroupedLinear,
    dequantized and multiplied per expert in fp32; bf16 out, the same bf16 wgrad"""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return EmulatedGroupedLinear.gemm(deq(*quant_rows(x)), deq(*quant_experts(w)), offs)

    @staticmethod
    def gemm(a, b, offs):  # per expert e: a[rows of e] · b[e]ᵀ in fp32
        out, start = torch.empty(a.shape[0], b.shape[1], device=a.device), 0
        for e, end in enumerate(offs.tolist()):
            out[start:end] = a[start:end] @ b[e].t()
            start = end
        return out.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        wt = deq(*quant_experts(w.transpose(-2, -1).contiguous()))
        dx = EmulatedGroupedLinear.gemm(deq(*quant_rows(dy)), wt, offs)
        dw = torch._grouped_mm(x.t(), dy, offs=offs).transpose(-2, -1)
        return dx, dw, None


def moe_layer(linear):
    """The MoE layer with `linear` (an autograd.Function of (x, w, offs)) for both GEMMs"""

    def layer(x, wr, w1, w2, k):
        tok, w, counts = route(x, wr, k)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x[tok]
        gu = linear.apply(xs, w1, offs)
        g, u = gu.chunk(2, dim=-1)
        h = F.silu(g) * u * w[:, None]
        y = linear.apply(h.contiguous(), w2, offs)
        out = torch.zeros_like(x)
        return out.index_add(0, tok, y)

    return layer


layer_fp8 = moe_layer(Fp8GroupedLinear)
layer_fp8_emulated = moe_layer(EmulatedGroupedLinear)


def read_ours(path):
    """{(shape, impl): ms} of ch01_moe_layer_bench's RESULT lines with fp32 main gradients
    (dw=add), for impl "grouped" (bf16) and "grouped+fp8" alike"""
    return {(s, impl): ms for (s, impl, dw), ms in read_results(path).items() if dw == "add"}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3,mixtral,qwen3-235b",
                    help="comma-separated, from: " + ", ".join(SHAPES))
    ap.add_argument("--impl", default=",".join(IMPLS), help="comma-separated: " + ", ".join(IMPLS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ours", help="ch01_moe_layer_bench --precision bf16,fp8 output")
    args = ap.parse_args()
    names, impls = args.shape.split(","), args.impl.split(",")
    for what, got, known in (("--shape", names, SHAPES), ("--impl", impls, IMPLS)):
        bad = [n for n in got if n not in known]
        if bad:
            ap.error(f"{what}: unknown {bad}; choose from {', '.join(known)}")
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    if not torch.cuda.is_available():
        print("skipped: no GPU (the PyTorch baselines run on CUDA)")
        return
    if not hasattr(torch, "_scaled_grouped_mm"):
        print(f"skipped: PyTorch {torch.__version__} has no torch._scaled_grouped_mm")
        return
    dev = torch.device("cuda")
    print(f"PyTorch {torch.__version__} FP8 MoE layer baseline | {torch.cuda.get_device_name()} | "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("forward+backward, weight gradients added into fp32 main gradients in the step; "
          f"median of {args.repeats} after {args.warmup} warm-up")
    fns = {"grouped_mm": layer_grouped, "grouped_mm_compiled": compile_layer(layer_grouped),
           "scaled_grouped_mm": layer_fp8, "scaled_grouped_mm_compiled": compile_layer(layer_fp8)}
    theirs = {}
    print("| shape      | impl                        |   ms/iter |  TFLOP/s |\n|---|---|---|---|")
    torch.manual_seed(0)
    for name in names:
        x, wr, w1, w2, k, dout = make_inputs(name, dev)
        T, H, Fh = x.shape[0], x.shape[1], w2.shape[2]
        # the check: the FP8 layer against its emulation (the same codes and scales, fp32
        # products; the bound fits bf16 outputs and fp32-vs-tensor-core sums), and how far
        # FP8 moves both from the bf16 layer (reported, not bounded: that is the recipe's
        # quantization error)
        outs = []
        for fn in (layer_fp8, layer_fp8_emulated, layer_grouped):
            y = fn(x, wr, w1, w2, k)
            (dx,) = torch.autograd.grad(y, x, dout)
            outs.append((y.detach(), dx))
        (yf, dxf), (ye, dxe), (yb, dxb) = outs
        ey, ex = rel(yf, ye), rel(dxf, dxe)
        print(f"check {name}: FP8 layer vs its fp32 emulation: output rel err {ey:.2e}, dgrad "
              f"rel err {ex:.2e} (bound 2e-2); FP8 vs the bf16 layer: output {rel(yf, yb):.2e}, "
              f"dgrad {rel(dxf, dxb):.2e}")
        assert ey < 2e-2 and ex < 2e-2, f"{name}: the FP8 layer disagrees with its emulation"
        del outs, yf, dxf, ye, dxe, yb, dxb
        flop = 6.0 * T * k * 3 * H * Fh
        for impl in impls:
            try:
                ms = bench(fns[impl], (x, wr, w1, w2, k), dout, args.warmup, args.repeats, 1)
            except Exception as e:  # a compile failure is a result, not a crash
                print(f"| {name:<10} | {impl:<27} | failed: {type(e).__name__}: {str(e)[:120]} | |")
                continue
            theirs[(name, impl)] = ms
            print(f"| {name:<10} | {impl:<27} | {ms:9.2f} | {flop / ms / 1e9:8.1f} |", flush=True)
        del x, wr, w1, w2, dout
        torch.cuda.empty_cache()
    if not args.ours:
        return
    ours = read_ours(args.ours)
    print("\nOur layer (ch01_moe_layer_bench, fp32 main gradients) against PyTorch's, ms; "
          "ratio = PyTorch / ours (> 1: ours faster)")
    print("| shape | ours FP8 | ours bf16 | ours FP8 vs ours bf16 | torch FP8 eager | "
          "torch FP8 compiled | torch bf16 compiled | vs torch FP8 eager | vs torch FP8 compiled "
          "| vs torch bf16 compiled |\n|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: f"{v:.2f}" if v else "-"
    rat = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
    for n in names:
        o8, o16 = ours.get((n, "grouped+fp8")), ours.get((n, "grouped"))
        te, tc, tb = (theirs.get((n, i)) for i in
                      ("scaled_grouped_mm", "scaled_grouped_mm_compiled", "grouped_mm_compiled"))
        print(f"| {n} | {fmt(o8)} | {fmt(o16)} | {rat(o16, o8)} | {fmt(te)} | {fmt(tc)} | "
              f"{fmt(tb)} | {rat(te, o8)} | {rat(tc, o8)} | {rat(tb, o8)} |")


if __name__ == "__main__":
    main()
