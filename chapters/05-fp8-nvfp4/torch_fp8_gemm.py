#!/usr/bin/env python3
"""PyTorch's dense FP8 GEMMs on the shapes of bin/ch05_fp8_gemm_bench, for comparison.

D[M,N] = A[M,K] @ B[N,K]^T with torch.mm (bf16, the baseline) and torch._scaled_mm:
tensorwise (one fp32 scale per operand), rowwise (one per row of A and of B) and, when this
PyTorch accepts it, blockwise 1x128 (A) x 128x128 (B), DeepSeek-V3's recipe. E4M3 operands,
bf16 output, use_fast_accum=False (as our cuBLASLt calls), plus tensorwise with fast
accumulation for reference. Quantization is done once, outside the timing: these are GEMM
times. Each output is checked first: ||D - D_fp32|| / ||D_fp32|| over the whole matrix.

The MoE expert GEMMs (--shape moe, or qwen3-fc1 ... mixtral-fc2, the shapes and group sizes
of bin/ch05_fp8_gemm_bench): torch._grouped_mm in bf16 and torch._scaled_grouped_mm with
rowwise FP8 scales (one per token row of X, one per output row of each expert's W), the
grouped FP8 GEMM PyTorch offers; checked against a per-group fp32 product.

  python3 chapters/05-fp8-nvfp4/torch_fp8_gemm.py [--shape all] [--repeats 15] [--ours tsv]

--ours: the TSV written by bin/ch05_fp8_gemm_bench --tsv, printed side by side at the end.
"""
import argparse
import statistics
import sys

import torch

SHAPES = [("dense", 8192, 8192, 8192), ("fc1", 16384, 14336, 4096),
          ("fc2", 16384, 4096, 14336), ("qwen", 16384, 1536, 4096)]
# name, experts, rows (tokens x top-k), N, K: as g_gshapes of ch05_fp8_gemm_bench.c
GSHAPES = [("qwen3-fc1", 128, 32768, 1536, 2048), ("qwen3-fc2", 128, 32768, 2048, 768),
           ("mixtral-fc1", 8, 16384, 28672, 4096), ("mixtral-fc2", 8, 16384, 4096, 14336)]
F8 = torch.float8_e4m3fn
FMAX = 448.0


def time_ms(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = start.elapsed_time(end)
    inner = max(1, min(50, int(3.0 / max(once, 1e-3)) + 1))
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def quant_tensor(x):
    s = FMAX / x.abs().max().float().clamp(min=1e-12)
    return (x.float() * s).to(F8), (1.0 / s).reshape(()).float()


def quant_rows(x):  # one scale per row
    s = FMAX / x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    return (x.float() * s).to(F8), (1.0 / s).float()


def quant_1x128(x):  # one scale per 1x128 tile: codes, scale_inv [rows, K/128]
    r, k = x.shape
    t = x.float().reshape(r, k // 128, 128)
    s = FMAX / t.abs().amax(dim=2, keepdim=True).clamp(min=1e-12)
    return (t * s).reshape(r, k).to(F8), (1.0 / s).reshape(r, k // 128)


def quant_128x128(w):  # one scale per 128x128 block: codes, scale_inv [N/128, K/128]
    n, k = w.shape
    t = w.float().reshape(n // 128, 128, k // 128, 128)
    s = FMAX / t.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    return (t * s).reshape(n, k).to(F8), (1.0 / s).reshape(n // 128, k // 128)


def group_sizes(G, rows):
    """group_sizes() of ch05_fp8_gemm_bench.c, to the row"""
    wts = [500 + (7919 * g) % 1000 for g in range(G)]
    tot = sum(wts)
    n = [rows * w // tot // 16 * 16 for w in wts]
    left, g = rows - sum(n), 0
    while left > 0:
        add = min(16, left)
        n[g] += add
        left -= add
        g = (g + 1) % G
    return n


def bench_grouped(args, results):
    """torch._grouped_mm (bf16) and torch._scaled_grouped_mm (rowwise FP8) on the MoE shapes"""
    g = torch.Generator(device="cuda").manual_seed(1235)
    for name, G, M, N, K in GSHAPES:
        if args.shape not in ("all", "moe", name):
            continue
        sizes = group_sizes(G, M)
        offs = torch.tensor(sizes, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)
        print(f"{name}: {G} experts, {M} rows ({min(sizes)} to {max(sizes)} per expert), "
              f"N={N}, K={K}")
        x = torch.randn(M, K, device="cuda", generator=g)
        x[M // 2:M // 2 + 16] *= 50.0
        xb = x.bfloat16()
        del x
        wb = (torch.randn(G, N, K, device="cuda", generator=g) * 0.02).bfloat16()
        ref = torch.empty(M, N, device="cuda")
        s0 = 0
        for e, n in enumerate(sizes):
            ref[s0:s0 + n] = xb[s0:s0 + n].float() @ wb[e].float().t()
            s0 += n
        refn = ref.norm()
        flops = 2.0 * M * N * K
        base = None

        def row(label, fn):
            nonlocal base
            try:
                out = fn()
                err = ((out.float() - ref).norm() / refn).item()
                ms = time_ms(fn, args.warmup, args.repeats)
            except Exception as e:  # not offered by this PyTorch / GPU
                print(f"{name:11} {M:6} {N:6} {K:6}  {label:38} not available: "
                      f"{str(e).splitlines()[0][:90]}")
                return
            base = base or ms
            ok = "ok" if err < 0.1 else "FAIL"
            print(f"{name:11} {M:6} {N:6} {K:6}  {label:38} {ms:9.3f} {flops / ms / 1e9:9.1f} "
                  f"{base / ms:7.2f}x  {err:.2e} {ok}", flush=True)
            results[(name, label)] = ms

        row("torch _grouped_mm bf16", lambda: torch._grouped_mm(xb, wb.transpose(-2, -1),
                                                                offs=offs))
        xr, sxr = quant_rows(xb)  # [M, K] codes, [M, 1] scale_inv
        wr, swr = quant_rows(wb.reshape(G * N, K))
        wr, swr = wr.reshape(G, N, K), swr.reshape(G, N)
        sa = sxr.reshape(M).contiguous()
        row("torch _scaled_grouped_mm rowwise", lambda: torch._scaled_grouped_mm(
            xr, wr.transpose(-2, -1), sa, swr, offs=offs, out_dtype=torch.bfloat16))
        del xr, wr, xb, wb, ref
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="all")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ours", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch_fp8_gemm: skipped: no GPU")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.cuda.get_device_name()
    print(f"PyTorch {torch.__version__} dense GEMMs | {dev} | CUDA {torch.version.cuda}")
    print(f"{'shape':6} {'M':>6} {'N':>6} {'K':>6}  {'GEMM':38} {'ms':>9} {'TFLOP/s':>9} "
          f"{'vs bf16':>8}  rel err (Frobenius, vs fp32)")
    results = {}
    g = torch.Generator(device="cuda").manual_seed(1234)
    for name, M, N, K in SHAPES:
        if args.shape not in ("all", name):
            continue
        x = torch.randn(M, K, device="cuda", generator=g)
        x[M // 2:M // 2 + 16] *= 50.0  # the same 16 outlier rows as our benchmark
        w = torch.randn(N, K, device="cuda", generator=g) * 0.02
        xb, wb = x.bfloat16(), w.bfloat16()
        ref = xb.float() @ wb.float().t()
        refn = ref.norm()
        del x, w
        flops = 2.0 * M * N * K
        base = None

        def row(label, fn):
            nonlocal base
            try:
                out = fn()
                err = ((out.float() - ref).norm() / refn).item()
                ms = time_ms(fn, args.warmup, args.repeats)
            except Exception as e:  # not offered by this PyTorch / GPU
                print(f"{name:6} {M:6} {N:6} {K:6}  {label:38} not available: "
                      f"{str(e).splitlines()[0][:90]}")
                return
            base = base or ms
            ok = "ok" if err < 0.1 else "FAIL"
            print(f"{name:6} {M:6} {N:6} {K:6}  {label:38} {ms:9.3f} {flops / ms / 1e9:9.1f} "
                  f"{base / ms:7.2f}x  {err:.2e} {ok}", flush=True)
            results[(name, label)] = ms

        row("torch bf16 mm", lambda: xb @ wb.t())
        xq, sx = quant_tensor(xb)
        wq, sw = quant_tensor(wb)
        row("torch _scaled_mm tensorwise", lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))
        row("torch _scaled_mm tensorwise fast-accum", lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True))
        xr, sxr = quant_rows(xb)
        wr, swr = quant_rows(wb)
        row("torch _scaled_mm rowwise", lambda: torch._scaled_mm(
            xr, wr.t(), scale_a=sxr, scale_b=swr.t(), out_dtype=torch.bfloat16))
        del xr, wr
        xk, sxk = quant_1x128(xb)
        wk, swk = quant_128x128(wb)
        sa = sxk.t().contiguous().t()  # [M, K/128], M contiguous (stride (1, M))
        sb = swk.t()  # [K/128, N/128], K/128 contiguous
        row("torch _scaled_mm blockwise 1x128x128x128", lambda: torch._scaled_mm(
            xk, wk.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
        del xk, wk, xq, wq, xb, wb, ref
        torch.cuda.empty_cache()
    print()
    bench_grouped(args, results)

    if args.ours:
        ours = {}
        with open(args.ours) as f:
            for line in f:
                p = line.rstrip("\n").split("\t")
                if len(p) == 7:
                    ours[(p[0], p[4])] = float(p[5])
        pairs = [("bf16 cuBLAS (baseline)", "torch bf16 mm"),
                 ("FP8 tensorwise E4M3", "torch _scaled_mm tensorwise"),
                 ("FP8 blockwise 1x128 x 128x128", "torch _scaled_mm blockwise 1x128x128x128")]
        print()
        print("ours vs PyTorch, same GPU, same run (TFLOP/s; ratio > 1: ours faster)")
        print(f"{'shape':6}  {'GEMM':32} {'ours':>9} {'torch':>9} {'ratio':>7}")
        for name, M, N, K in SHAPES:
            flops = 2.0 * M * N * K
            for o, t in pairs:
                if (name, o) in ours and (name, t) in results:
                    a, b = ours[(name, o)], results[(name, t)]
                    print(f"{name:6}  {o:32} {flops / a / 1e9:9.1f} {flops / b / 1e9:9.1f} "
                          f"{b / a:6.2f}x")
        gpairs = [("bf16 grouped (ours, baseline)", "torch _grouped_mm bf16"),
                  ("FP8 grouped blockwise (ours)", "torch _scaled_grouped_mm rowwise"),
                  ("FP8 grouped blockwise (ours)", "torch _grouped_mm bf16"),
                  ("FP8 grouped, lockstep issue (variant)", "torch _scaled_grouped_mm rowwise"),
                  ("FP8 grouped, ordered issue (variant)", "torch _scaled_grouped_mm rowwise")]
        for name, G, M, N, K in GSHAPES:
            flops = 2.0 * M * N * K
            for o, t in gpairs:
                if (name, o) in ours and (name, t) in results:
                    a, b = ours[(name, o)], results[(name, t)]
                    print(f"{name:11}  {o:30} vs {t:33} {flops / a / 1e9:7.1f} "
                          f"{flops / b / 1e9:7.1f} {b / a:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
