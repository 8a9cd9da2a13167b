#!/usr/bin/env python3
"""PyTorch SDPA timings for chapter 07's attention benchmark (bin/ch07_attention_bench).

For each shape B,H,T,D given on the command line, and for SDPA's FLASH_ATTENTION and
CUDNN_ATTENTION backends: causal bf16 attention on q, k, v stored [B, T, H, D] (the layout
moe.c's kernels read, seen by SDPA as [B, H, T, D] through a transpose), timed with CUDA
events, the median of --repeats after --warmup calls, forward alone, backward alone (from a
saved graph) and forward + backward. Before timing, each backend's output and gradients are
checked against the other backend's on the same inputs.

Prints one line per (backend, shape) for the C program to parse:
    sdpa <backend> B H T D <fwd ms> <bwd ms> <fwd+bwd ms> <max rel. diff to the other backend>
or  sdpa <backend> B H T D error <message>
"""
import argparse
import statistics
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+", help="B,H,T,D")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # noqa: BLE001 - any import failure means "no SDPA here"
        print(f"sdpa unavailable: {e}")
        return 0
    if not torch.cuda.is_available():
        print("sdpa unavailable: no CUDA device")
        return 0
    print(f"sdpa torch {torch.__version__} cudnn {torch.backends.cudnn.version()}", flush=True)
    backends = [("FLASH_ATTENTION", SDPBackend.FLASH_ATTENTION),
                ("CUDNN_ATTENTION", SDPBackend.CUDNN_ATTENTION)]

    def timed(fn, reps):
        times = []
        for _ in range(reps):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    for spec in args.shapes:
        B, H, T, D = (int(x) for x in spec.split(","))
        g = torch.Generator(device="cuda").manual_seed(1)
        mk = lambda: torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                 generator=g).transpose(1, 2).requires_grad_(True)
        q, k, v = mk(), mk(), mk()
        dy = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        results = {}
        for name, be in backends:
            try:
                with sdpa_kernel([be]):
                    def fwd():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    y = fwd()
                    gq, gk, gv = torch.autograd.grad(y, (q, k, v), dy)
                    results[name] = (y.detach().float(), gq.float(), gk.float(), gv.float())
                    for _ in range(args.warmup):
                        torch.autograd.grad(fwd(), (q, k, v), dy)
                    t_f = timed(lambda: fwd(), args.repeats)
                    t_fb = timed(lambda: torch.autograd.grad(fwd(), (q, k, v), dy), args.repeats)

                    def bwd_only():
                        torch.autograd.grad(y, (q, k, v), dy, retain_graph=True)
                    y = fwd()
                    t_b = timed(bwd_only, args.repeats)
                    del y
                results[name + "_t"] = (t_f, t_b, t_fb)
            except Exception as e:  # noqa: BLE001 - report and go on with the other backend
                msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
                print(f"sdpa {name} {B} {H} {T} {D} error {msg}", flush=True)
        # each backend against the other (max |a-b| / max |b| over y, dq, dk, dv)
        diff = float("nan")
        if "FLASH_ATTENTION" in results and "CUDNN_ATTENTION" in results:
            diff = max(float((a - b).abs().max() / b.abs().max())
                       for a, b in zip(results["FLASH_ATTENTION"], results["CUDNN_ATTENTION"]))
        for name, _ in backends:
            if name + "_t" in results:
                t_f, t_b, t_fb = results[name + "_t"]
                print(f"sdpa {name} {B} {H} {T} {D} {t_f:.4f} {t_b:.4f} {t_fb:.4f} {diff:.3e}",
                      flush=True)
        del q, k, v, dy, results
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
