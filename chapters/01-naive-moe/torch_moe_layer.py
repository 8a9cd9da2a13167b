#!/usr/bin/env python3
"""PyTorch baselines for chapters 01 and 03: the MoE layer, forward + backward, in bf16.

Implementations of the same layer as moe.c's (softmax top-k router, tokens permuted by
expert, SwiGLU experts with the routing weight applied after the activation, combine by
summing):

  loop                  a Python loop over experts, one pair of GEMMs each (chapter 01)
  grouped_mm            torch._grouped_mm over all experts at once (what chapter 03 must beat)
  grouped_mm_compiled   the same function through torch.compile (what a user comparing
                        honestly runs); its compilation is part of the warm-up, not timed

Each grouped_mm variant is timed twice: alone (its weight gradients are bf16, as
torch._grouped_mm writes them) and "+main_grad", adding them into fp32 main gradients
(main_grad += grad.float()) inside the timed step, which is what a mixed-precision trainer
needs and what our layer produces directly.

TFLOP/s counts the expert GEMMs only, 6*T*k*3*H*F, exactly as ch01_moe_layer_bench does.
Timing: CUDA events, warm-up, median of repeats. loop and grouped_mm are checked against
each other on the first iteration before being timed.

With --ours FILE (the output of ch01_moe_layer_bench, RESULT lines), the script ends with
the comparison table of chapter 03: ours vs PyTorch eager and compiled, in both modes.

    python3 chapters/01-naive-moe/torch_moe_layer.py [--shape qwen3|mixtral|models|sweep|all]
                                                     [--impl loop,grouped_mm,...] [--ours FILE]
"""
import argparse
import datetime
import re
import statistics

import torch
import torch.nn.functional as F

# the shapes of lib/bench.c (keep the two tables the same)
SHAPES = {
    "qwen3": dict(T=16384, H=2048, F=768, E=128, k=8),
    "mixtral": dict(T=8192, H=4096, F=14336, E=8, k=2),
    "qwen3-235b": dict(T=8192, H=4096, F=1536, E=128, k=8),
    "dsv2-lite": dict(T=16384, H=2048, F=1408, E=64, k=6),
    "preset": dict(T=8192, H=384, F=768, E=8, k=2),  # the GPU preset's MoE layer
}
for _r in (64, 128, 256, 512, 1024, 2048, 4096, 8192):  # rows per expert, at most 256 experts
    _T = 8192 if _r >= 256 else 256 * _r // 8
    SHAPES[f"sweep{_r}"] = dict(T=_T, H=4096, F=1536, E=_T * 8 // _r, k=8)
GROUPS = {"models": ["qwen3", "mixtral", "qwen3-235b", "dsv2-lite"],
          "sweep": [n for n in SHAPES if n.startswith("sweep")]}
GROUPS["big"] = GROUPS["models"] + GROUPS["sweep"]
GROUPS["auto"] = ["qwen3", "mixtral"]
GROUPS["all"] = GROUPS["big"]
IMPLS = ["loop", "grouped_mm", "grouped_mm_compiled"]


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


def make_inputs(name, dev):
    """The layer's bf16 inputs for shape `name`: x [T, H] and the weights (router [E, H],
    fc1 [E, 2F, H], fc2 [E, H, F]) requiring gradients, k, and the output gradient [T, H]"""
    s = SHAPES[name]
    T, H, Fh, E, k = s["T"], s["H"], s["F"], s["E"], s["k"]
    bf = torch.bfloat16
    x = torch.randn(T, H, device=dev, dtype=bf, requires_grad=True)
    wr = (0.02 * torch.randn(E, H, device=dev)).to(bf).requires_grad_()
    w1 = (0.02 * torch.randn(E, 2 * Fh, H, device=dev)).to(bf).requires_grad_()
    w2 = (0.02 * torch.randn(E, H, Fh, device=dev)).to(bf).requires_grad_()
    return x, wr, w1, w2, k, torch.randn(T, H, device=dev, dtype=bf)


def compile_layer(fn):
    """torch.compile(fn), one compiled function for every shape: dynamic shapes after the
    first recompile, and room in the cache for the distinct k values and sizes of a list"""
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    return torch.compile(fn)


def bench(fn, tensors, dout, warmup, repeats, main_grad):
    """Median ms of forward + backward; with main_grad, plus main_grad += grad.float() for
    every weight (the fp32 gradient accumulation of a mixed-precision trainer)."""
    x, wr, w1, w2, k = tensors
    mains = [torch.zeros(t.shape, device=t.device, dtype=torch.float32) for t in (wr, w1, w2)]

    def step():
        for t in (x, wr, w1, w2):
            t.grad = None
        fn(x, wr, w1, w2, k).backward(dout)
        if main_grad:
            for m, t in zip(mains, (wr, w1, w2)):
                m.add_(t.grad.float())

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def read_results(path):
    """{(shape, impl, dw): ms} of ch01_moe_layer_bench's RESULT lines"""
    results = {}
    pat = re.compile(r"RESULT layer shape=(\S+) impl=(\S+) dw=(\S+) ms=([0-9.]+)")
    with open(path) as f:
        for line in f:
            m = pat.search(line)
            if m:
                results[m.group(1, 2, 3)] = float(m.group(4))
    return results


def read_ours(path):
    """{(shape, dw): ms} of our grouped kernel (bf16) from ch01_moe_layer_bench's output"""
    return {(s, dw): ms for (s, impl, dw), ms in read_results(path).items() if impl == "grouped"}


def comparison(ours, theirs, names):
    """The chapter 03 table: (a) ours with fp32 main gradients vs PyTorch + main_grad,
    (b) ours writing bf16 weight gradients vs PyTorch alone; ratio = PyTorch ms / ours."""
    print("\nLayer forward+backward, ms (ratio = PyTorch / ours: > 1 means ours is faster)")
    print("(a) fp32 main gradients: ours adding (+=) and storing (=, a step's first "
          "micro-batch) vs PyTorch + main_grad += grad.float()")
    print("| shape | ours += | ours = | eager+mg | compiled+mg | += vs eager | += vs compiled "
          "| = vs compiled |\n|---|---|---|---|---|---|---|---|")
    fmt = lambda v: f"{v:.2f}" if v else "-"
    rat = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
    for n in names:
        oa, os_ = ours.get((n, "add")), ours.get((n, "store"))
        e, c = theirs.get((n, "grouped_mm", 1)), theirs.get((n, "grouped_mm_compiled", 1))
        print(f"| {n} | {fmt(oa)} | {fmt(os_)} | {fmt(e)} | {fmt(c)} | {rat(e, oa)} | "
              f"{rat(c, oa)} | {rat(c, os_)} |")
    print("\n(b) bf16 weight gradients: ours (bf16 dw) vs PyTorch alone")
    print("| shape | ours bf16 | eager | compiled | vs eager | vs compiled |\n"
          "|---|---|---|---|---|---|")
    for n in names:
        ob = ours.get((n, "bf16"))
        e, c = theirs.get((n, "grouped_mm", 0)), theirs.get((n, "grouped_mm_compiled", 0))
        print(f"| {n} | {fmt(ob)} | {fmt(e)} | {fmt(c)} | {rat(e, ob)} | {rat(c, ob)} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="auto", choices=[*GROUPS, *SHAPES])
    ap.add_argument("--impl", default=",".join(IMPLS),
                    help="comma-separated: " + ", ".join(IMPLS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ours", help="ch01_moe_layer_bench output: end with the comparison table")
    args = ap.parse_args()
    impls = args.impl.split(",")
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        ap.error(f"--impl: unknown {bad}; choose from {IMPLS}")
    if not torch.cuda.is_available():
        print("skipped: no GPU (the PyTorch baselines run on CUDA)")
        return
    dev = torch.device("cuda")
    print(f"PyTorch {torch.__version__} baselines | {torch.cuda.get_device_name()} | "
          f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC")
    compiled = compile_layer(layer_grouped)
    fns = {"loop": layer_loop, "grouped_mm": layer_grouped, "grouped_mm_compiled": compiled}
    names = GROUPS.get(args.shape, [args.shape])
    theirs = {}
    print("| shape      | impl                        |   ms/iter |  TFLOP/s |\n|---|---|---|---|")
    torch.manual_seed(0)
    for name in names:
        x, wr, w1, w2, k, dout = make_inputs(name, dev)
        T, H, Fh = x.shape[0], x.shape[1], w2.shape[2]
        tensors = (x, wr, w1, w2, k)
        with torch.no_grad():
            a = layer_loop(x, wr, w1, w2, k).float()
            b = layer_grouped(x, wr, w1, w2, k).float()
            err = ((a - b).norm() / a.norm()).item()
        assert err < 2e-2, f"{name}: loop and grouped_mm disagree (rel err {err:.3e})"
        flop = 6.0 * T * k * 3 * H * Fh
        for impl in impls:
            for mg in ((0,) if impl == "loop" else (0, 1)):
                ms = bench(fns[impl], tensors, dout, args.warmup, args.repeats, mg)
                theirs[(name, impl, mg)] = ms
                label = impl + (" +main_grad" if mg else "")
                print(f"| {name:<10} | {label:<27} | {ms:9.2f} | {flop / ms / 1e9:8.1f} |",
                      flush=True)
        del x, wr, w1, w2, dout, tensors
        torch.cuda.empty_cache()
    if args.ours:
        comparison(read_ours(args.ours), theirs, names)


if __name__ == "__main__":
    main()
