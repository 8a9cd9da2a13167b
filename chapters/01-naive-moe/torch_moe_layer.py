#!/usr/bin/env python3
"""PyTorch baselines for chapter 01: the MoE layer, forward + backward, in bf16.

Two implementations of the same layer as moe.c's (softmax top-k router, tokens permuted by
expert, SwiGLU experts with the routing weight applied after the activation, combine by
summing):

  loop         a Python loop over experts, one pair of GEMMs each (what chapter 01 does)
  grouped_mm   torch._grouped_mm over all experts at once (what chapter 03 must beat)

TFLOP/s counts the expert GEMMs only, 6*T*k*3*H*F, exactly as ch01_moe_layer_bench does.
Timing: CUDA events, warm-up, median of repeats. Both are checked against each other on the
first iteration before being timed.

    python3 chapters/01-naive-moe/torch_moe_layer.py [--shape qwen3|mixtral|all] [--repeats 7]
"""
import argparse
import datetime
import statistics

import torch
import torch.nn.functional as F

SHAPES = {
    "qwen3": dict(T=16384, H=2048, F=768, E=128, k=8),
    "mixtral": dict(T=8192, H=4096, F=14336, E=8, k=2),
}


def route(x, wr, k):
    logits = (x @ wr.t()).float()
    topv, topi = logits.topk(k, dim=-1)
    probs = topv.softmax(-1)
    T = x.shape[0]
    flat_e = topi.flatten()
    order = torch.argsort(flat_e, stable=True)
    tok = torch.arange(T, device=x.device).repeat_interleave(k)[order]
    w = probs.flatten()[order].to(x.dtype)
    counts = torch.bincount(flat_e, minlength=wr.shape[0])
    return tok, w, counts


def layer_loop(x, wr, w1, w2, k):
    tok, w, counts = route(x, wr, k)
    xs = x[tok]
    ys, start = [], 0
    for e, c in enumerate(counts.tolist()):  # .tolist(): the host sync of the naive loop
        if c == 0:
            continue
        gu = xs[start:start + c] @ w1[e].t()
        g, u = gu.chunk(2, dim=-1)
        h = F.silu(g) * u * w[start:start + c, None]
        ys.append(h @ w2[e].t())
        start += c
    out = torch.zeros_like(x)
    return out.index_add(0, tok, torch.cat(ys))


def layer_grouped(x, wr, w1, w2, k):
    tok, w, counts = route(x, wr, k)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[tok]
    gu = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    h = F.silu(g) * u * w[:, None]
    y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    out = torch.zeros_like(x)
    return out.index_add(0, tok, y)


def bench(fn, tensors, dout, warmup, repeats):
    x, wr, w1, w2, k = tensors
    for _ in range(warmup):
        fn(x, wr, w1, w2, k).backward(dout)
    times = []
    for _ in range(repeats):
        for t in (x, wr, w1, w2):
            t.grad = None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x, wr, w1, w2, k).backward(dout)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="all", choices=["all", *SHAPES])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no GPU (the PyTorch baselines run on CUDA)")
        return
    dev = torch.device("cuda")
    print(f"PyTorch {torch.__version__} baselines | {torch.cuda.get_device_name()} | "
          f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC")
    print("| shape    | impl       |   ms/iter |  TFLOP/s |\n|---|---|---|---|")
    torch.manual_seed(0)
    for name, s in SHAPES.items():
        if args.shape not in ("all", name):
            continue
        T, H, Fh, E, k = s["T"], s["H"], s["F"], s["E"], s["k"]
        bf = torch.bfloat16
        x = torch.randn(T, H, device=dev, dtype=bf, requires_grad=True)
        wr = (0.02 * torch.randn(E, H, device=dev)).to(bf).requires_grad_()
        w1 = (0.02 * torch.randn(E, 2 * Fh, H, device=dev)).to(bf).requires_grad_()
        w2 = (0.02 * torch.randn(E, H, Fh, device=dev)).to(bf).requires_grad_()
        dout = torch.randn(T, H, device=dev, dtype=bf)
        tensors = (x, wr, w1, w2, k)
        with torch.no_grad():
            a = layer_loop(x, wr, w1, w2, k).float()
            b = layer_grouped(x, wr, w1, w2, k).float()
            err = ((a - b).norm() / a.norm()).item()
        assert err < 2e-2, f"{name}: loop and grouped_mm disagree (rel err {err:.3e})"
        flop = 6.0 * T * k * 3 * H * Fh
        for impl, fn in (("loop", layer_loop), ("grouped_mm", layer_grouped)):
            ms = bench(fn, tensors, dout, args.warmup, args.repeats)
            print(f"| {name:<8} | {impl:<10} | {ms:9.2f} | {flop / ms / 1e9:8.1f} |", flush=True)
        del x, wr, w1, w2, dout, tensors
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
