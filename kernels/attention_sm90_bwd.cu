/*
 * The Hopper (sm_90a) flash-attention backward: wgmma + TMA, warp-specialised, the
 * deterministic two-kernel split of the portable backward (attention.cu: read its header for
 * the math and the semantics: dq, dk, dv are ADDED to, GQA sums dk, dv over the query heads
 * of a group, causal with the q_pos/k_pos offset, a row that sees no key contributes
 * nothing). moe_cuda_attention_backward computes δ = rowsum(dy ⊙ y) with its fa_delta_kernel
 * and then calls moe_cuda_attention_sm90_backward() first, which, for head dims 64 and 128
 * on an sm_90 device, runs this file's fused kernel (below: "The fused backward"; in
 * FlashAttention-3's order inside an iteration, "Mode 6", the default; MOE_FLASH_SM90_BWD=2
 * for its first order, mode 2, the same bits), its two kernels with MOE_FLASH_SM90_BWD=1
 * (mode 1), and otherwise (=0, or another device or head dim) says no, so the portable
 * kernels run.
 *
 * STATUS: both modes passed tests/gpu_attention.c's test_attention_sm90_backward on an H100
 * (mode 1 at cc04ca2, mode 2 at 16ee93c) and gave the same bits as each other and as the
 * portable backward on all its shapes (not in general: mode 2 rounds its fp32 dq sum once
 * per key tile; the GPU preset's loss at step 60 is 2.2659 with it, 2.2567 with mode 1).
 * At 16K, D = 128 causal, mode 1 ran 326 TFLOP/s (1.85x the portable backward) and mode 2
 * 381 TFLOP/s (7.22 against 8.44 ms; D = 64: 313 against 199), so mode 2 is the default
 * (docs/results/07-long-context.md). Modes 3, 4 and 5 passed the same test on an H100 at
 * 27db17a (3: mode 2's bits; 4 and 5: mode 2's dk, dv bits, dq within a few ulps of mode 2's)
 * and were measured in the same call at 16K (D = 128 / 64, TFLOP/s, mode 2: 381 / 309):
 * mode 3 (MOE_FLASH_SM90_BWD=3, below: mode 2 with overlap) 375 / 294, opt-in; mode 4
 * (=4, below: mode 2 without the dq ordering, NOT deterministic) 400 / 323, so the ordering
 * costs mode 2 about 5 %; opt-in, never the default, as the library's gradients are
 * bit-reproducible; mode 5 (=5: mode 4 with a batched dk/dv epilogue) 395 / 319, opt-in.
 * Modes 6 and 7 passed the same test on an H100 at 6fe39a1 and 53dcef4 (6: mode 2's dq, dk,
 * dv bits; 7: mode 2's dk, dv bits, its dq equal to mode 2's in both runs of the test) and
 * were measured beside modes 1-5 in one process each (TFLOP/s, D = 128, mode 2 / 6 / 7): 4K
 * 324 / 329 / 327, 16K 378 / 395 / 417, 32K 402 / 411 / 420; D = 64 at 16K 308 / 309 / 320.
 * So mode 6 (deterministic, mode 2's bits, 1.02-1.05x at D = 128) is the default since
 * 3553226; mode 7 (not deterministic, 1.04-1.10x) stays opt-in, as mode 4 does.
 *
 * The math, per (b, query head h, group g = h / (Hq/Hkv)), with sl = log2(e)/√D and
 * lse₂ = lse·log2(e) (0 for a row that sees nothing: every key of it is masked anyway):
 *
 *   P  = exp2(S·sl − lse₂)   with S = Q Kᵀ, masked to 0 (key > t + q_pos − k_pos, key ≥ Tk)
 *   dP = dY Vᵀ,   dS = P ⊙ (dP − δ)
 *   dV += Pᵀ dY,  dK += dSᵀ Q / √D,  dQ += dS K / √D
 *
 * Why two kernels and not FlashAttention-3's one. FA3 runs one CTA per key tile and adds
 * each key tile's dS K into dq with fp32 atomics (a separate kernel converts dq to bf16): 5
 * tile products, but the order of the additions into dq changes from run to run, so two runs
 * differ in the last bits. This library's backward is deterministic (the portable one is,
 * and tests/gpu_attention.c checks it), so, as the portable backward does, the work splits
 * by what a CTA owns:
 *
 *   dk/dv kernel   one CTA per (b, g, key tile of 128 keys); it owns dk and dv of its keys.
 *                  It loops over the query heads of the group and, for each, over the query
 *                  tiles of 64 rows that see its keys (the causal skip: from the first query
 *                  that sees key s0), always in the same order:
 *                    Sᵀ  = K Qᵀ      m64n64k16 SS: K [keys][D] and Q [queries][D], both
 *                                    K-major (D contiguous), D/16 instructions
 *                    dPᵀ = V dYᵀ     the same with V and dY
 *                    Pᵀ, dSᵀ         in registers (lse₂ and δ per COLUMN: from shared memory)
 *                    dV += Pᵀ dY     m64nDk16 RS: A = Pᵀ from registers (the forward's
 *                                    fragment trick: the accumulator of Sᵀ, rows = keys,
 *                                    columns = queries, IS the A fragment with k = queries),
 *                                    B = dY [queries][D] read MN-major (transposed)
 *                    dK += dSᵀ Q     the same with dSᵀ and Q
 *                  No operand needs a transpose through shared memory: Pᵀ and dSᵀ come out
 *                  of Sᵀ = K Qᵀ already with the keys as rows, the M of the next products.
 *   dq kernel      one CTA per (b, h, query tile of 128 rows); it owns dq of its rows. It
 *                  loops over the key tiles of 64 keys that its last row sees (the forward's
 *                  causal skip):
 *                    S = Q Kᵀ, dP = dY Vᵀ    m64n64k16 SS, K-major both
 *                    dS                       in registers (lse₂, δ per row)
 *                    dQ += dS K               m64nDk16 RS: A = dS from registers, B = K
 *                                             [keys][D] read MN-major (the forward's P V)
 *
 *   So S and dP are computed twice (7 tile products instead of FA3's 5): about 1.4x the
 *   tensor-core work, bought for bit-reproducible gradients and no fp32 dq workspace. Both
 *   kernels use only operand forms the forward already runs (SS K-major × K-major, RS with an
 *   MN-major B), with boxes of 64 rows where the forward has 128.
 *
 *   warp specialisation  as the forward: 2 consumer warpgroups (warps 0-7, 240 registers
 *             each with setmaxnreg) own 64 rows each of the CTA's resident tile (dk/dv: 64
 *             keys, dq: 64 query rows), and 1 producer warpgroup (24 registers) of which one
 *             warp works: it loads the resident tiles once (K and V; or Q and dY) and
 *             streams the other operand pair through a ring of STAGES stages with TMA
 *             (full barriers count the bytes, empty barriers count the 8 consumer warps).
 *             In the dk/dv kernel the producer warp's 32 lanes also copy the tile's 64 lse₂
 *             and δ into the stage before announcing it (plain stores; the arrive releases
 *             them, the consumers' wait acquires them).
 *   registers dk/dv at D = 128: dK, dV 64 + 64 fp32, Sᵀ and dPᵀ 32 + 32, Pᵀ, dSᵀ as bf16
 *             16 + 16 per thread. dq: dQ 64, S, dP 32 + 32, dS 16.
 *   memory    dk/dv, D = 128: K, V 2 × 32 KB + 3 stages × (Q, dY 2 × 16 KB) = 160 KB;
 *             dq, D = 128: Q, dY 2 × 32 KB + 4 stages × (K, V 2 × 16 KB) = 192 KB.
 *             Every box is [rows][64 bf16] with the 128-byte swizzle, 1024-byte aligned;
 *             MN-major reads step 16 rows = 2048 bytes per k16, LBO = the box size (the next
 *             64 columns of D).
 *   masks     applied only to the tiles that cross the diagonal, Tq or Tk. Rows past Tq and
 *             keys past Tk are TMA's zero fill; their P is masked to 0 (dk/dv) or never
 *             stored (dq), and their δ and lse₂ are 0.
 *   epilogue  each thread adds its accumulators (× 1/√D for dq, dk) to the bf16 outputs in
 *             place: read the pair, add in fp32, round once, as the portable kernel does.
 *
 * The fused backward (MOE_FLASH_SM90_BWD=2): FlashAttention-3's 5 products, deterministic.
 * One kernel, the dk/dv kernel's CTAs (b, g, key tile of 128 keys, the same loop over the
 * group's query heads and the query tiles of 64 rows that see the keys, the same Sᵀ, dPᵀ,
 * Pᵀ, dSᵀ, dV, dK instructions: dk and dv come out as mode 1's), plus per iteration
 *
 *   dQ_tile = dS K    64 queries × D over the CTA's 128 keys, added to an fp32 accumulator
 *                    acc [B, Hq, Tq, D] in global memory; then a small kernel adds
 *                    acc / √D to the bf16 dq (one rounding, as the epilogues do).
 *
 *   operands  dS is in registers as dSᵀ (rows = keys, each warpgroup 64 of them), but dQ's
 *             rows are queries and its sum runs over both warpgroups' keys, so dS goes
 *             through shared memory: each thread stores its dSᵀ bf16 pairs (the A fragments
 *             it just fed to dK) into a [128 keys][64 queries] tile of 128-byte swizzled rows
 *             (conflict-free: the 8 rows of a store land in 8 different chunks). That tile
 *             read MN-major IS dS as wgmma's A (M = queries contiguous, K = keys: 8 k16 steps
 *             of 16 rows = 2048 bytes, the RS products' B form); B = the resident K box of
 *             64 head-dim columns read MN-major (keys = K rows, the same form). So it is an
 *             SS m64n64k16 with both transpose bits: no new layout, no register transpose.
 *             Warpgroup p computes dq's columns 64p .. 64p + 63 (D = 128: both, 32 floats
 *             each, in Sᵀ's registers, free by then: no extra registers); at D = 64 warpgroup
 *             0 computes all 64 (an N = 32 half would need a 64-byte swizzle for K's MN-major
 *             read; the warpgroups share the tensor cores, so the other's idle turn is cheap).
 *             dS is double-buffered (16 KB each): the copy iteration it writes was last read by
 *             iteration it − 2's dq products, which both warpgroups waited for before the
 *             named barrier (1) of iteration it − 1 that says both halves of dS are written.
 *   the add   through a staging buffer and TMA, by a third role: warp 1 of the producer
 *             warpgroup (the store warp, 24 registers like the producer). The consumers write
 *             their dQ accumulator in the swizzled layout of [64 rows][32 fp32] TMA boxes
 *             (sm90_epilogue.cuh's stage_piece) and go on; the store warp hands the boxes to
 *             TMA over a 3-D fp32 tensor map of acc (rows past Tq are outside it: TMA skips
 *             them). Named barriers 2 (buffer empty: the store warp arrives after TMA has
 *             READ it) and 3 (full: the consumers arrive) hand the one buffer back and forth.
 *   order     deterministic because every (b, h, query tile) of acc is added to in one fixed
 *             order, ascending key tile, with a semaphore per (b, h, query tile) [B, Hq,
 *             ⌈Tq/64⌉] (FlashAttention-3's Deterministic mode): the store warp of key tile j
 *             spins (ld.acquire.gpu) until the tile's semaphore is j, issues its TMA copy-out,
 *             waits until the copy has COMPLETED (cp.async.bulk.wait_group 0, not .read),
 *             fences the async proxy and posts (red.release.gpu add 1). The key tiles that see
 *             a query tile m are always a prefix 0 .. J(m): a CTA walks every query tile from
 *             the first that sees its first key to the end, that first query tile grows with
 *             j, and a CTA whose keys no query sees is followed only by such CTAs. So exactly
 *             the j tiles before j add to m first, for causal masks with any q_pos/k_pos
 *             offset (CP chunks), for queries wholly after the keys (no mask: every key tile
 *             sees every query tile), for rows that see nothing (no key tile reaches their
 *             tile: the add kernel skips tiles whose semaphore stayed 0), for Tq, Tk not
 *             multiples of the tiles, and for GQA (the semaphore is per query head; the
 *             group's CTA walks its heads one after the other). Key tile 0 STORES where the
 *             others add, so acc needs no zeroing (only the semaphores: a memset).
 *   deadlock  a CTA only waits for CTAs of the same (b, g) with a smaller key tile. It takes
 *             its tile from a ticket counter (atomicAdd at its start) instead of blockIdx,
 *             with the key tile as the slowest index: the CTAs it waits for took smaller
 *             tickets, so they have started, are resident or done, and by induction finish
 *             (the smallest unfinished ticket waits for nobody). That holds whatever order
 *             the hardware starts CTAs in (FlashAttention-3 relies on the launch order).
 *             Ascending order also starts the heaviest CTAs first (key tile 0: every query
 *             tile sees it), like mode 1. Its cost: within a (b, g), CTA j adds to tile m
 *             after CTA j − 1, so the CTAs of one chain running at once finish together, at
 *             the pace of the one that started first (a simulation of the list schedule:
 *             +2..5 % over the ideal for MHA at 4K-64K tokens, 16-64 heads; more where few
 *             (b, g) chains are long, e.g. GQA 4 with 4 KV heads, +26 %, where FA3's order,
 *             descending key tile with the shortest CTAs launched first, loses as much).
 *   workspace acc (B·Hq·Tq·D fp32), the semaphores and the ticket: the scratch slot
 *             MOE_SCRATCH_ATTENTION_DQ (cuda_common.cu: kept between calls, grown in the
 *             first call of a shape, i.e. in lib/graph.c's eager warm-up, never inside a
 *             capture; growing moves the memory epoch so captured graphs are re-captured).
 *             Each call only memsets the semaphores and the ticket on the op's stream.
 *   memory    D = 128: K, V 64 KB + 2 stages × 32 KB + dS 2 × 16 KB + dq staging 32 KB =
 *             192 KB; D = 64: 32 + 3 × 16 + 32 + 16 = 128 KB.
 *   registers ptxas (nvcc 13, -Xptxas -v): 168 at launch (240 for the consumers after
 *             setmaxnreg, 24 for the producer warpgroup), no spills at D = 128; at D = 64 the
 *             producer warpgroup's two roles spill 20 bytes (the consumers do not). The dq
 *             accumulator reuses Sᵀ's registers, so the consumers' peak is mode 1's.
 *
 * Mode 3 (MOE_FLASH_SM90_BWD=3, opt-in): mode 2's kernel (OVERLAP = 1) with the overlap
 * FlashAttention-3's backward has inside a warpgroup. Mode 2 waits for all of a tile's
 * products at once: Sᵀ and dPᵀ together, then Pᵀ and dSᵀ with the tensor cores idle (but
 * for the other warpgroup, which barrier 1 keeps in step with this one, so it is mostly in
 * its own arithmetic at the same time). Mode 3 commits them in separate groups and waits
 * for one at a time: Pᵀ = exp2(...) is computed as soon as Sᵀ is there while dPᵀ's wgmmas
 * run; dV += Pᵀ dY is issued at once, and dSᵀ computed (and stored for dq) while it runs;
 * then dK, barrier 1, dQ as in mode 2, the stage released while dQ runs. The operations,
 * their operands and the order of every accumulation (dK, dV, each dq tile, the semaphore-
 * ordered adds) are mode 2's, so mode 3 gives mode 2's bits (tests/gpu_attention.c asserts
 * it). Registers (ptxas, nvcc 13): no spills at D = 128 (the consumers' peak, during dSᵀ, is
 * dK, dV, Sᵀ, dPᵀ, Pᵀ = 208 live accumulator/fragment registers, as in mode 2); at D = 64
 * the same 20 bytes of the producer warpgroup's spill as mode 2; ptxas reports no wgmma
 * serialisation (C7514). Not done: carrying the dQ product into the next iteration (its
 * staging under the next Sᵀ): ptxas then serialised every wgmma of the kernel, as it does
 * whenever the count of pending groups at the loop head depends on the path; the next
 * tile's Sᵀ, dPᵀ issued before this tile's Pᵀ, dSᵀ (FlashAttention-3's forward-style
 * intra-warpgroup pipelining) needs a second Sᵀ, dPᵀ (64 registers): 272 at D = 128; and
 * ping-pong of the two warpgroups.
 *
 * Mode 4 (MOE_FLASH_SM90_BWD=4, opt-in, NOT deterministic): mode 2's kernel (NONDET = 1)
 * without the semaphores, FlashAttention-3's default mode. The store warp hands each staged
 * dq tile to TMA as a reduce-add (cp.reduce.async.bulk.tensor ... .add, fp32, done in L2)
 * as soon as the consumers have staged it: no spin on the tile's semaphore, no wait for the
 * copy to complete, no post. Only the buffer's hand-back stays: TMA must have READ the
 * staging buffer (cp.async.bulk.wait_group.read) before the consumers write the next tile
 * (the consumers fence their stores to the async proxy before they announce it, as in mode
 * 2), and the warp waits for its copies to complete once, before it exits. So key tile 0 adds
 * too, and acc is zeroed first (the launcher's memset covers the whole workspace: the
 * semaphores, unused, the ticket, acc). The add kernel then takes every row
 * (fa_sm90_dq_add_all_kernel): a row that sees no key has acc = +0 (its P, hence its dS, is
 * masked to 0 in the tiles that reach it; nothing is added where none does), and dq + 0 is
 * dq. The ticket order stays (nobody waits, so it cannot deadlock; it starts the heaviest
 * CTAs first). What it measures: the cost of mode 2's ordering (a CTA's store warp waits for
 * key tile j − 1's add to the same query tile, then for its own add to complete, and the
 * consumers stall on the staging buffer whenever the store warp falls an iteration behind).
 * What changes: the fp32 additions into each acc element happen in the order the CTAs reach
 * them, so dq differs from run to run in its last bits (dk and dv do not: they are mode 2's
 * instructions and bits). tests/gpu_attention.c asserts dk, dv = mode 2's bits and dq within
 * a few bf16 ulps of mode 2's. Registers (ptxas, nvcc 13): 168 at launch; no spills at D =
 * 128; at D = 64 the producer warpgroup spills 24 bytes (mode 2: 20). The consumers' code is
 * mode 2's; tools/device_code_diff.py reports modes 1-3's kernels unchanged.
 *
 * Mode 5 (MOE_FLASH_SM90_BWD=5, opt-in, NOT deterministic): mode 4 (NONDET = 2) with the dk/dv
 * epilogue's loads batched (fa_add_dkdv<D, true>). Where Nsight Compute counts "uncoalesced"
 * global sectors in mode 2's kernel (32 % excessive at 16K, D = 128), they are the dk/dv
 * epilogue's: its only other generic global accesses are the producer's lse₂, δ loads (32
 * lanes, 128 contiguous bytes: coalesced) and the semaphore's one-lane poll and post (one
 * sector each, no excess); TMA's copies are not counted. fa_add_rows reads and writes bf16
 * pairs, 4 bytes a lane: an instruction covers 8 rows × 16 bytes, 8 sectors of 32 bytes each
 * half used (2× the ideal), 64 loads and 64 stores a thread at D = 128: per CTA 8 warps ×
 * 128 × 8 = 8192 sectors, half of them excess; over the 16K, D = 128, 16-head grid 16.8 M
 * against the lse₂, δ loads' 4.2 M (16 a query tile) and the polls. Their bytes are few
 * (≈ 0.5 GB of sector traffic against ≈ 17 GB of TMA loads and reduce-adds), but the PTX
 * alternates load, store 64 times (the compiler keeps a load after the store before it: it
 * cannot prove the addresses differ), so if ptxas keeps that order too, each thread waits
 * for 64 L2 round trips one after the other while the CTA holds its SM (one CTA an SM: 193
 * KB of shared memory) with its tensor cores idle. Mode 5 issues each tensor's 2 × D/8 loads
 * first (D/4 registers, free by then), then adds and stores: the same operations on the same
 * values, so dk and dv keep mode 2's bits (asserted). The half-used sectors stay (8-byte
 * accesses would need a quad shuffle of the accumulator: not done).
 *
 * What FlashAttention-3 does differently (hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp,
 * flash_bwd_kernel_sm90.h, flash_bwd_launch_template.h, read at 0251105a). Its Hopper
 * configuration for causal hdim 128 is kBlockM = 64 queries, kBlockN = 128 keys, 2 MMA
 * warpgroups (240 registers each, producer warpgroup 24: our budget), SdP_swapAB (it computes
 * Sᵀ and dPᵀ, 64 keys × 64 queries a warpgroup, m64n64k16 SS: our tile), dV, dK as RS
 * m64n128k16 over the 64 queries (Mma_dKV_is_RS: ours), dQ as SS m64n64k16 with the
 * warpgroups splitting D (AtomLayoutMdQ = 1: ours), dS double-buffered in shared memory
 * (ours), Q and dO 2 stages each. So at D = 128 every product, its wgmma N and the register
 * budget are the same as mode 2's; what differs is WHEN things happen in an iteration:
 *
 *   1. The waits. FA3 issues Sᵀ and dPᵀ as two groups, waits for Sᵀ alone and computes Pᵀ
 *      while dPᵀ runs (mode 3 does this too). Then: dSᵀ, dS to shared memory, issue dV;
 *      barrier; issue dQ; wait for dV (dQ runs); issue dK; wait for dQ (dK runs); stage dQ
 *      for the store warp WHILE dK RUNS; wait for dK. Mode 2 stages dq after waiting for all
 *      of its products, so its staging (32 fp32 stores a thread, a named barrier with the
 *      store warp) runs with its tensor pipe idle, and the next Sᵀ cannot start until it is
 *      done. Expected effect in a latency-bound kernel: the staging leaves the critical path
 *      (a few hundred cycles of an iteration of ≈ 6600 at 381 TFLOP/s); one wgmma of the
 *      warpgroup is in flight during every elementwise phase but dSᵀ.
 *   2. The dq hand-off is per warpgroup: FA3 has a dQ-empty and a dQ-full barrier for each
 *      MMA warpgroup (128 + 32 threads), and its store warp issues each warpgroup's part as
 *      soon as that part is staged. Mode 2 syncs both warpgroups and the store warp on one
 *      barrier (288 threads): a second rendezvous of the two warpgroups per iteration,
 *      beside the dS barrier both designs need. Expected effect: less lockstep, so one
 *      warpgroup's arithmetic can overlap the other's wgmmas more often.
 *   3. lse₂ and δ come by TMA with Q and dO (1-D bulk copies on the same barriers, from
 *      arrays the preprocess kernel writes already multiplied by log2 e and padded to the
 *      tile); our producer warp loads them with plain loads and stores them before it issues
 *      the stage's TMA: an L2 round trip in front of every stage's copy. With 2 stages and
 *      an iteration of several microseconds it has slack; it would matter nearer the peak.
 *   4. dQ goes to global memory as a 1-D bulk reduce-add of the warpgroup's accumulator in
 *      register order (dQaccum lives in a permuted layout that the postprocess kernel
 *      undoes), stored to shared memory with 16-byte vector stores; ours stages in TMA's
 *      swizzled box layout (4-byte stores) for a tensor reduce-add. dS goes to shared
 *      memory with stmatrix (4 instructions a thread), ours with 16 4-byte stores.
 *   5. Non-deterministic by default (mode 4 measured that: 5 %); its deterministic mode
 *      orders by semaphore like mode 2, with the key tiles in descending order for causal.
 *   6. At hdim 64 the shape differs: kBlockM = 128 queries, so Sᵀ and dPᵀ are m64n128k16
 *      (N = 128, twice ours: half the iterations and waits per FLOP), dV and dK have K = 128,
 *      and BOTH warpgroups compute dQ (AtomLayoutMdQ = 2: 64 query rows each), where our D
 *      = 64 leaves warpgroup 1 idle during dQ. It keeps lse₂ and δ split across the 8
 *      threads that share them and fetches them by shuffle (ShuffleLSE) to fit in 240
 *      registers, and separates the causal-mask iterations from the rest.
 *
 * Mode 6 (MOE_FLASH_SM90_BWD=6 or unset: the default, deterministic) takes differences 1 and 2; mode 7
 * (=7, NOT deterministic) is mode 6 without the semaphores, as mode 4 is mode 2 without
 * them: the like-for-like comparison with FlashAttention-3's default. See "Mode 6" below.
 *
 * Mode 6: mode 2's kernel (OVERLAP = 2) with FlashAttention-3's order inside an iteration:
 *
 *   issue Sᵀ | issue dPᵀ | wait Sᵀ: Pᵀ (dPᵀ runs) | wait dPᵀ: dSᵀ, dS → shared memory |
 *   issue dV += Pᵀ dY | barrier 1 | issue dQ = dS K | wait dV (dQ runs) |
 *   issue dK += dSᵀ Q | wait dQ (dK runs): stage dq | wait dK: release the stage
 *
 * and a dq hand-off per warpgroup: warpgroup p stages its part and syncs only with the store
 * warp, on named barriers 2 + 2p (part p empty) and 3 + 2p (part p full), each counting 160
 * threads: warpgroup p's 128 (sync on empty, arrive on full) and the store warp's 32 (arrive
 * on empty, sync on full). Per part and iteration exactly one arrival of each side, the store
 * warp's first "empty" before its loop and none after the last iteration (nit arrivals
 * against the warpgroup's nit syncs), so the generations cannot mix: the store warp arrives
 * on "empty" of generation k + 1 only after its sync on "full" of generation k, which needs
 * the warpgroup past "empty" k. At D = 64 only part 0 exists (warpgroup 0 computes all of
 * dq) and only barriers 2 and 3 are used. The store warp takes part 0 then part 1 (each as
 * soon as its warpgroup has staged it) and frees both once TMA has read them (FA3 frees each
 * part once its own copy is read: one more wait, and no fewer spills in the 24-register
 * store warp, so not done).
 * In deterministic mode 6 it still waits for the tile's semaphore before both parts and
 * posts after both have completed: the order of the adds into acc is mode 2's. The products,
 * their operands (Pᵀ, dSᵀ by fa_tile_p and fa_tile_ds, mode 3's split, mode 2's bits) and the
 * order of every accumulation are mode 2's, so mode 6 gives mode 2's dq, dk, dv bits
 * (asserted by tests/gpu_attention.c); mode 7 gives mode 2's dk, dv bits and a dq within a
 * few ulps. The dS double buffer stays safe: warpgroup p waits for its dQ of iteration it − 2
 * (the wait before the staging) before it reaches barrier 1 of iteration it − 1, which the
 * other warpgroup must pass before writing copy it % 2 in iteration it. The stage is
 * released after dK (Q is read by dK, the last product); mode 2 released it after dV, dK
 * with dQ still running, so the producer gets the slot slightly later. Registers: the peak
 * is during Pᵀ (dK, dV 128, Sᵀ 32, dPᵀ 32 in flight) or after the packs (+ Pᵀ, dSᵀ 32 bf16
 * pairs) as in mode 3; while dK runs and dq is staged, dK, dV, dSᵀ (in flight) and dQ = 176.
 *
 * STATUS (modes 6, 7): passed test_attention_sm90_backward on an H100 (6fe39a1, 53dcef4,
 * 4d137f4) and measured there; mode 6 is the default (the file's header, "STATUS").
 *
 * sm_100a has no wgmma: this file builds there (the kernel bodies compile to a trap) and the
 * launcher runs them only on a device of compute capability 9.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_sm90.cuh"
#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "sm90_epilogue.cuh"
#include "sm90_ptx.cuh"
#include "wgmma.cuh"

namespace {

constexpr int THREADS = 384;       /* 2 consumer warpgroups + 1 producer warpgroup */
constexpr int BIG = 128;           /* the resident tile: keys (dk/dv) or query rows (dq) */
constexpr int SMALL = 64;          /* the streamed tile: query rows (dk/dv) or keys (dq) */
constexpr int BOX_BIG = FA_SM90_BOX;       /* [128 rows][64 bf16]: 16 KB */
constexpr int BOX_SMALL = FA_SM90_BOX / 2; /* [64 rows][64 bf16]: 8 KB */
constexpr int MAX_STAGES = 4;
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr float LOG2E = 1.4426950408889634f;
#endif

/* Shared memory of both kernels: two resident tiles of BIG rows, then a ring of STAGES
 * stages of two streamed tiles of SMALL rows. */
template <int D, int STAGES_> struct Layout {
    static constexpr int NC = D / 64;              /* boxes across the head dimension */
    static constexpr int RES = NC * BOX_BIG;       /* one resident tile */
    static constexpr int TILE = NC * BOX_SMALL;    /* one streamed tile */
    static constexpr int STAGE = 2 * TILE;
    static constexpr int STAGES = STAGES_;
    static constexpr int BYTES = 2 * RES + STAGES * STAGE + 1024; /* + alignment slack */
    static_assert(STAGES <= MAX_STAGES && BYTES <= 227 * 1024, "shared memory");
};
template <int D> using LayoutKV = Layout<D, 3>; /* D = 128: 64 + 96 KB */
template <int D> using LayoutQ = Layout<D, 4>;  /* D = 128: 64 + 128 KB */

/* The fused kernel's (MOE_FLASH_SM90_BWD=2): the dk/dv kernel's tiles and ring, then the dS
 * tile twice (iteration it writes copy it % 2) and the dq staging buffer (NP parts of
 * [64 rows][64 fp32], each two TMA boxes [64][32 fp32] of 8 KB). D = 128: 64 + 64 + 32 +
 * 32 KB. */
template <int D, int STAGES_> struct LayoutF : Layout<D, STAGES_> {
    static constexpr int NP = D / 64;     /* 64-column parts of dq: warpgroup p computes part p */
    static constexpr int DS = BIG * 128;  /* dS: [128 keys][64 queries] bf16 = 16 KB */
    static constexpr int PART = 64 * 64 * 4;
    static constexpr int BYTES = Layout<D, STAGES_>::BYTES + 2 * DS + NP * PART;
    static_assert(BYTES <= 227 * 1024 - 2048, "shared memory (with the static lse₂, δ)");
};
template <int D> using LayoutFused = LayoutF<D, D == 128 ? 2 : 3>; /* D = 64: 112 KB */

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* The fused kernel's named barriers (0 is __syncthreads'). */
constexpr int BAR_DS = 1;       /* both consumer warpgroups have written their dS rows */
constexpr int BAR_DQ_EMPTY = 2; /* the store warp has read the dq staging buffer */
constexpr int BAR_DQ_FULL = 3;  /* the consumers have written it */
#endif

struct Args {
    int Tq, Tk, Hq, Hkv;
    int off;     /* q_pos − k_pos: query t sees key s iff s ≤ t + off */
    float scale; /* 1/√D */
};

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* out[0..1] += (x0, x1) for a bf16 pair in global memory (4-byte aligned: even column). */
__device__ __forceinline__ void fa_add_pair(moe_bf16 *out, float x0, float x1) {
    uint32_t *p = reinterpret_cast<uint32_t *>(out);
    const __nv_bfloat162 old = *reinterpret_cast<const __nv_bfloat162 *>(p);
    *p = fa_pack_bf16(__low2float(old) + x0, __high2float(old) + x1);
}

/* Add a warpgroup's m64nDk16 accumulator acc (× mul) to rows row0 + lane/4 (+ 8) of
 * out [rows][stride], columns 0..D−1; rows ≥ nrows are skipped. */
template <int D>
__device__ __forceinline__ void fa_add_rows(moe_bf16 *out, size_t stride, int row0, int nrows,
                                            const float *acc, float mul, int lane) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = row0 + 8 * i;
        if (r >= nrows)
            continue;
        moe_bf16 *o = out + (size_t)r * stride + 2 * (lane % 4);
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            fa_add_pair(o + 8 * n, acc[4 * n + 2 * i] * mul, acc[4 * n + 2 * i + 1] * mul);
    }
}

/* The accumulator of a 64 × 64 product (32 floats per thread) → the A fragments of its 4
 * k-blocks of 16 columns, as bf16 pairs: k-block kb is a[4kb .. 4kb + 3] (the fragment
 * trick of attention_sm90.cu). */
__device__ __forceinline__ void fa_pack_a(uint32_t a[16], const float x[32]) {
#pragma unroll
    for (int n = 0; n < 8; n++) {
        a[2 * n] = fa_pack_bf16(x[4 * n], x[4 * n + 1]);
        a[2 * n + 1] = fa_pack_bf16(x[4 * n + 2], x[4 * n + 3]);
    }
}

/* The release of a stage by a consumer warp. */
__device__ __forceinline__ void fa_release(uint64_t *empty, int lane) {
    __syncwarp();
    if (lane == 0)
        mbar_arrive(empty);
}

/* x[0..31] = A·Bᵀ (64 × 64) for the warpgroup: A = 64 rows of a resident tile (boxes of
 * BOX_BIG bytes along D), B = a streamed tile of 64 rows (boxes of BOX_SMALL), both K-major:
 * D/16 k-steps of 32 bytes, 4 per box. Issued, not committed. */
template <int D>
__device__ __forceinline__ void fa_issue_abt(float *x, const uint8_t *a, const uint8_t *b) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        moe_wgmma<64, 0, 0>::mma(x, fa_desc_kmajor(a + (kk / 4) * BOX_BIG + (kk % 4) * 32),
                                 fa_desc_kmajor(b + (kk / 4) * BOX_SMALL + (kk % 4) * 32),
                                 kk > 0);
}

/* acc (64 × D) += A·B with A = a[16] (64 × 64 from registers: 4 k-blocks) and B = a
 * streamed tile [64 k-rows][D] read MN-major (4 k16 steps of 2048 bytes; LBO = the next box
 * of 64 columns). Issued, not committed. */
template <int D>
__device__ __forceinline__ void fa_issue_rs(float *acc, const uint32_t *a, const uint8_t *b) {
#pragma unroll
    for (int kb = 0; kb < 4; kb++)
        moe_wgmma_rs<D, 1>::mma(acc, a + 4 * kb, fa_desc_mnmajor(b + kb * 2048, BOX_SMALL), 1);
}

/* ------------------------------------------- what the dk/dv and the fused kernel share */

/* The query tiles that a CTA of the key tile starting at s0 walks, for each of the rep
 * query heads of its group: qt0 .. qt0 + per − 1 (from the first query that sees key s0:
 * q_pos + t ≥ k_pos + s0), nit = rep · per iterations. False when no query sees the keys. */
struct KvWork {
    int qt0, per, nit;
};
__device__ __forceinline__ bool fa_kv_work(int s0, int rep, const Args &a, KvWork &w) {
    const long long first = (long long)s0 - a.off;
    if (first >= a.Tq)
        return false;
    w.qt0 = first > 0 ? (int)(first / SMALL) : 0;
    w.per = (a.Tq + SMALL - 1) / SMALL - w.qt0;
    w.nit = rep * w.per;
    return true;
}

/* The producer warp of a key-tile CTA: K and V of keys s0 .. s0 + 127 of KV head g once,
 * then for each iteration the query tile's Q and dY into the ring (its lanes first copy the
 * tile's 64 lse₂ and δ into the stage: plain stores, released by the arrive that announces
 * the stage, acquired by the consumers' wait). */
template <typename L>
__device__ __forceinline__ void fa_produce_q_dy(
    int tid, uint8_t *Ks, uint8_t *Vs, uint8_t *ring, float (*Ls)[SMALL], float (*Ds)[SMALL],
    uint64_t *kvbar, uint64_t *full, uint64_t *empty, const CUtensorMap *mq,
    const CUtensorMap *mk, const CUtensorMap *mv, const CUtensorMap *mdy, const float *lse,
    const float *delta, const Args &a, int g, int b, int s0, int rep, const KvWork &w) {
    constexpr int NC = L::NC, STAGES = L::STAGES;
    if (tid == 0) {
        mbar_expect_tx(kvbar, 2 * L::RES);
        for (int c = 0; c < NC; c++) {
            tma_load_4d(Ks + c * BOX_BIG, mk, kvbar, 64 * c, g, s0, b);
            tma_load_4d(Vs + c * BOX_BIG, mv, kvbar, 64 * c, g, s0, b);
        }
    }
    for (int it = 0; it < w.nit; it++) {
        const int s = it % STAGES, phase = (it / STAGES) & 1;
        const int hh = g * rep + it / w.per, t0 = (w.qt0 + it % w.per) * SMALL;
        mbar_wait(&empty[s], phase ^ 1); /* a fresh barrier passes parity 1 */
        for (int c = tid; c < SMALL; c += 32) {
            const int t = t0 + c;
            const size_t at = ((size_t)b * a.Hq + hh) * a.Tq + t;
            const float lt = t < a.Tq ? lse[at] : -INFINITY;
            Ls[s][c] = lt == -INFINITY ? 0.0f : lt * LOG2E;
            Ds[s][c] = t < a.Tq ? delta[at] : 0.0f;
        }
        __threadfence_block(); /* each lane's stores before lane 0's releasing arrive */
        __syncwarp();
        if (tid == 0) {
            uint8_t *qt = ring + s * L::STAGE, *dyt = qt + L::TILE;
            mbar_expect_tx(&full[s], L::STAGE); /* releases the lanes' Ls, Ds stores */
            for (int c = 0; c < NC; c++) {
                tma_load_4d(qt + c * BOX_SMALL, mq, &full[s], 64 * c, hh, t0, b);
                tma_load_4d(dyt + c * BOX_SMALL, mdy, &full[s], 64 * c, hh, t0, b);
            }
        }
        __syncwarp();
    }
}

/* One iteration's transposed tiles for a consumer warpgroup (its 64 keys × the 64 queries
 * t0 ..): waits for the stage, Sᵀ = K Qᵀ and dPᵀ = V dYᵀ, then st = Pᵀ (masked) and
 * dpt = dSᵀ = Pᵀ ⊙ (dPᵀ − δ) without 1/√D, with lse₂ ls[] and δ ds[] per column. */
template <int D>
__device__ __forceinline__ void fa_tile_p_ds(float st[32], float dpt[32], const uint8_t *ka,
                                             const uint8_t *va, const uint8_t *qt,
                                             const uint8_t *dyt, uint64_t *full, int phase,
                                             const float *ls, const float *ds, int key, int s0,
                                             int t0, int lane, const Args &a, float sl) {
    mbar_wait(full, phase);
    wgmma_fence();
    fa_issue_abt<D>(st, ka, qt);
    fa_issue_abt<D>(dpt, va, dyt);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 32; i++) {
        reg_fence(st[i]);
        reg_fence(dpt[i]);
    }
    const bool mask = s0 + BIG - 1 > t0 + a.off || t0 + SMALL > a.Tq || s0 + BIG > a.Tk;
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int c = 8 * n + 2 * (lane % 4) + (e & 1), t = t0 + c;
            const int kr = key + 8 * (e >> 1);
            float p = exp2f(fmaf(st[4 * n + e], sl, -ls[c]));
            if (mask && (kr > t + a.off || t >= a.Tq || kr >= a.Tk))
                p = 0.0f;
            st[4 * n + e] = p;                            /* Pᵀ */
            dpt[4 * n + e] = p * (dpt[4 * n + e] - ds[c]); /* dSᵀ (without 1/√D) */
        }
}

/* Mode 3's split of fa_tile_p_ds's arithmetic, so that a wgmma runs under each half: Pᵀ
 * once Sᵀ is there (while dPᵀ is computed), dSᵀ once dPᵀ is there (while dV += Pᵀ dY is).
 * Element for element the same operations as fa_tile_p_ds (the same bits); that one keeps
 * its fused loop because sharing these helpers changed the PTX of the verified modes. */
__device__ __forceinline__ void fa_tile_p(float st[32], const float *ls, int key, int s0,
                                          int t0, int lane, const Args &a, float sl) {
#pragma unroll
    for (int i = 0; i < 32; i++)
        reg_fence(st[i]);
    const bool mask = s0 + BIG - 1 > t0 + a.off || t0 + SMALL > a.Tq || s0 + BIG > a.Tk;
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int c = 8 * n + 2 * (lane % 4) + (e & 1), t = t0 + c;
            const int kr = key + 8 * (e >> 1);
            float p = exp2f(fmaf(st[4 * n + e], sl, -ls[c]));
            if (mask && (kr > t + a.off || t >= a.Tq || kr >= a.Tk))
                p = 0.0f;
            st[4 * n + e] = p; /* Pᵀ */
        }
}

/* ... and dpt = dSᵀ = Pᵀ ⊙ (dPᵀ − δ) (without 1/√D) from st = Pᵀ (masked: 0 where masked). */
__device__ __forceinline__ void fa_tile_ds(float dpt[32], const float st[32], const float *ds,
                                           int lane) {
#pragma unroll
    for (int i = 0; i < 32; i++)
        reg_fence(dpt[i]);
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int c = 8 * n + 2 * (lane % 4) + (e & 1);
            dpt[4 * n + e] = st[4 * n + e] * (dpt[4 * n + e] - ds[c]);
        }
}


/* Mode 5's epilogue: fa_add_dkdv's arithmetic (the same bits) with each tensor's loads issued
 * before any of its stores. In fa_add_rows every load follows the store before it (the
 * compiler cannot prove that out + r·stride + 8n and the next pair's address differ, and
 * keeps the order: the PTX alternates load, store 64 times), so the stores wait for the loads
 * one L2 round trip at a time, with the CTA's tensor cores idle until the last one. Here a
 * thread loads its 2 rows × D/8 pairs (D/4 registers), then adds and stores them: one round
 * trip per tensor. The rows' 16-byte pieces per instruction (8 rows × 4 lanes × 4 bytes:
 * half of each 32-byte sector used) are unchanged. */
template <int D>
__device__ __forceinline__ void fa_add_rows_batched(moe_bf16 *out, size_t stride, int row0,
                                                    int nrows, const float *acc, float mul,
                                                    int lane) {
    uint32_t old[2][D / 8];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const uint32_t *o = reinterpret_cast<const uint32_t *>(
            out + (size_t)(row0 + 8 * i) * stride + 2 * (lane % 4));
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            old[i][n] = row0 + 8 * i < nrows ? o[4 * n] : 0u; /* pair n: columns 8n + .. */
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (row0 + 8 * i >= nrows)
            continue;
        uint32_t *o =
            reinterpret_cast<uint32_t *>(out + (size_t)(row0 + 8 * i) * stride + 2 * (lane % 4));
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162 *>(&old[i][n]);
            const float x0 = acc[4 * n + 2 * i] * mul, x1 = acc[4 * n + 2 * i + 1] * mul;
            o[4 * n] = fa_pack_bf16(__low2float(v) + x0, __high2float(v) + x1);
        }
    }
}

/* The key-tile CTA's epilogue: dk += dK/√D, dv += dV for the thread's keys key, key + 8;
 * BATCHED (mode 5): through fa_add_rows_batched, the same bits. */
template <int D, bool BATCHED = false>
__device__ __forceinline__ void fa_add_dkdv(moe_bf16 *dk, moe_bf16 *dv, float *adk, float *adv,
                                            int key, int g, int b, int lane, const Args &a) {
#pragma unroll
    for (int i = 0; i < D / 2; i++) {
        reg_fence(adk[i]);
        reg_fence(adv[i]);
    }
    const size_t kvs = (size_t)a.Hkv * D;
    const size_t base = (size_t)b * a.Tk * kvs + (size_t)g * D;
    if constexpr (BATCHED) {
        fa_add_rows_batched<D>(dk + base, kvs, key, a.Tk, adk, a.scale, lane);
        fa_add_rows_batched<D>(dv + base, kvs, key, a.Tk, adv, 1.0f, lane);
    } else {
        fa_add_rows<D>(dk + base, kvs, key, a.Tk, adk, a.scale, lane);
        fa_add_rows<D>(dv + base, kvs, key, a.Tk, adv, 1.0f, lane);
    }
}

/* ------------------------------------------------- the fused kernel's dq pieces */

/* A warpgroup's dSᵀ fragments da (fa_pack_a of rows row, row + 8 = keys, 64 query columns)
 * into the dS tile [128 keys][64 queries] bf16 of 128-byte swizzled rows: element (key r,
 * query c) at moe_swizzle128(r, c / 8) + 2 (c % 8). The 8 rows of one store instruction
 * fall in 8 different 16-byte chunks of their bank window: no bank conflicts. */
__device__ __forceinline__ void fa_store_ds(uint8_t *ds, const uint32_t da[16], int row,
                                            int lane) {
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int i = 0; i < 2; i++)
            *reinterpret_cast<uint32_t *>(ds + moe_swizzle128(row + 8 * i, n) + 4 * (lane % 4)) =
                da[2 * n + i];
}

/* acc (64 queries × 64 columns of part p) = dS·K over the CTA's 128 keys: A = dS read from
 * the dS tile MN-major (M = queries contiguous; 8 k16 steps of 16 key rows = 2048 bytes),
 * B = the resident K box of columns 64p .. 64p + 63 read MN-major (N = the head dimension
 * contiguous, the same rows). Issued, not committed. */
__device__ __forceinline__ void fa_issue_dq(float *acc, const uint8_t *ds, const uint8_t *kbox) {
#pragma unroll
    for (int kk = 0; kk < BIG / 16; kk++)
        moe_wgmma<64, 1, 1>::mma(acc, fa_desc_mnmajor(ds + kk * 2048, BIG * 128),
                                 fa_desc_mnmajor(kbox + kk * 2048, BOX_BIG), kk > 0);
}

/* A dq-computing warpgroup hands its finished dq product acc (64 queries × 64 columns, whose
 * wgmma it has waited for) to the store warp: once the store warp has read the last one
 * (named barrier 2), into its part of the staging buffer in TMA's [64][32 fp32] box layout,
 * then announce it (3). SPLIT (modes 6, 7): warpgroup wg's own pair of barriers instead, 2 +
 * 2·wg (its part empty) and 3 + 2·wg (full), of 160 threads: the warpgroup and the store
 * warp, not the other warpgroup. */
template <int NP, bool SPLIT = false>
__device__ __forceinline__ void fa_stage_dq(float acc[32], uint8_t *part, int tid, int wg = 0) {
    constexpr int NB = SPLIT ? 128 + 32 : NP * 128 + 32;
    const int bar = SPLIT ? 2 * wg : 0;
#pragma unroll
    for (int i = 0; i < 32; i++)
        reg_fence(acc[i]);
    named_bar_sync(BAR_DQ_EMPTY + bar, NB); /* the store warp has read the last */
    stage_piece<1, 64, 64 * 64 * 4>(acc, part, 0, tid);
    fence_proxy_async(); /* our stores → TMA's reads */
    named_bar_arrive(BAR_DQ_FULL + bar, NB);
}

/* The semaphore of a (b, h, query tile): spin (one thread) until it reaches v; acquire, so
 * that what the CTAs before released is visible to this thread's later accesses. */
__device__ __forceinline__ void fa_sem_wait(const int *sem, int v) {
    int x;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(x) : "l"(sem) : "memory");
    } while (x < v);
}

/* ... and its increment, releasing this thread's earlier writes (and what it acquired). */
__device__ __forceinline__ void fa_sem_post(int *sem) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(sem) : "memory");
}

/* One dq part's boxes to TMA (issuing lane): a plain store for key tile 0 of the ordered
 * modes, a reduce-add otherwise. */
template <int NONDET>
__device__ __forceinline__ void fa_issue_dq_part(const CUtensorMap *mdq, const uint8_t *src,
                                                 int p, int j, int m, int bh) {
#pragma unroll
    for (int box = 0; box < 2; box++) {
        if (!NONDET && j == 0)
            tma_store_3d(mdq, src + box * 8192, 64 * p + 32 * box, m * SMALL, bh);
        else
            tma_reduce_add_3d(mdq, src + box * 8192, 64 * p + 32 * box, m * SMALL, bh);
    }
}

/* The store warp of the fused kernel (warp 1 of the producer warpgroup): for each
 * iteration, in the consumers' order, it waits until the tile's semaphore says that the j
 * key tiles before this one have added their part, takes the consumers' dq tile from the
 * staging buffer and hands it to TMA (a plain store for key tile 0, the first: the
 * accumulator needs no zeroing; a reduce-add, done in L2, for the others), frees the
 * buffer once TMA has read it, waits until the writes are complete, and posts the
 * semaphore. Rows past Tq are outside the tensor map: TMA skips them.
 * NONDET (modes 4, 5, 7): no semaphore, no wait for completion, no post: every key tile's
 * dq tile is a reduce-add into the zeroed acc as soon as it is staged, in whatever order the
 * CTAs get there; the buffer is freed once TMA has read it (.read), and the warp waits for
 * its copies to complete only once, before it exits.
 * SPLIT (modes 6 and 7, the header's "Mode 6"): a hand-off per warpgroup. Part p has its own
 * pair of barriers, "full" 3 + 2p and "empty" 2 + 2p, 160 threads each (warpgroup p arrives
 * on full and syncs on empty; this warp the other way round), and the warp takes part 0 then
 * part 1, each as soon as its warpgroup has staged it. Without SPLIT one pair (3, 2) counts
 * all NP warpgroups + this warp. Either way each barrier sees one arrival of each side per
 * iteration: the initial "empty" before the loop and none after the last iteration. */
template <int NP, int NONDET, bool SPLIT = false>
__device__ __forceinline__ void fa_store_dq(int lane, const CUtensorMap *mdq, const uint8_t *dqs,
                                            int *sem, int j, int g, int b, int rep,
                                            const KvWork &w, const Args &a) {
    constexpr int PAIRS = SPLIT ? NP : 1;                /* barrier pairs */
    constexpr int NB = (SPLIT ? 1 : NP) * 128 + 32;      /* the threads of each barrier */
    /* few live registers (this warp has 24): the tile walks m = qt0 .. qt0 + per − 1 for
     * each head, and sem points at the semaphore of (bh, m), [bh][M] */
    const int M = (a.Tq + SMALL - 1) / SMALL, mend = w.qt0 + w.per;
    int bh = b * a.Hq + g * rep, m = w.qt0;
    int *tsem = sem + (size_t)bh * M + m;
#pragma unroll
    for (int q = 0; q < PAIRS; q++)
        named_bar_arrive(BAR_DQ_EMPTY + 2 * q, NB); /* the buffers start free */
    for (int it = 0; it < w.nit; it++) {
        if constexpr (!NONDET) {
            if (lane == 0) {
                fa_sem_wait(tsem, j); /* key tiles 0 .. j−1 see tile m too: they come first */
                fence_proxy_async_global(); /* ... and before our TMA reduce-add */
            }
            __syncwarp();
        }
#pragma unroll
        for (int q = 0; q < PAIRS; q++) {
            named_bar_sync(BAR_DQ_FULL + 2 * q, NB); /* the consumers fenced their stores to
                                                        the async proxy before they arrived */
            if (lane == 0)
#pragma unroll
                for (int p = SPLIT ? q : 0; p < (SPLIT ? q + 1 : NP); p++)
                    fa_issue_dq_part<NONDET>(mdq, dqs + p * (64 * 64 * 4), p, j, m, bh);
            __syncwarp();
        }
        if (lane == 0) {
            bulk_commit();
            bulk_wait_read(); /* TMA has read every part */
        }
        __syncwarp();
#pragma unroll
        for (int q = 0; q < PAIRS; q++)
            if (it + 1 < w.nit)
                named_bar_arrive(BAR_DQ_EMPTY + 2 * q, NB); /* may be written again */
        if constexpr (!NONDET) {
            if (lane == 0) {
                bulk_wait_all();            /* the adds are done in global memory ... */
                fence_proxy_async_global(); /* ... ordered before the generic release */
                fa_sem_post(tsem);
            }
            __syncwarp();
        }
        tsem++;
        if (++m == mend) { /* the next query head of the group */
            m = w.qt0;
            bh++;
            tsem += M - w.per;
        }
    }
    if constexpr (NONDET) {
        if (lane == 0)
            bulk_wait_all(); /* every reduce-add issued has completed before the CTA exits */
        __syncwarp();
    }
}
#endif

/* ------------------------------------------------------------------ dk, dv */

template <int D>
__global__ void __launch_bounds__(THREADS, 1)
    fa_sm90_dkdv_kernel(const __grid_constant__ CUtensorMap mq,
                        const __grid_constant__ CUtensorMap mk,
                        const __grid_constant__ CUtensorMap mv,
                        const __grid_constant__ CUtensorMap mdy, moe_bf16 *dk, moe_bf16 *dv,
                        const float *lse, const float *delta, const Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef LayoutKV<D> L;
    constexpr int STAGES = L::STAGES;
    extern __shared__ uint8_t fa_smem_raw[];
    uint8_t *Ks = fa_smem_raw + ((1024 - (smem_u32(fa_smem_raw) & 1023)) & 1023);
    uint8_t *Vs = Ks + L::RES;
    uint8_t *ring = Vs + L::RES; /* stage s: Q at ring + s·STAGE, dY TILE bytes after it */
    __shared__ float Ls[MAX_STAGES][SMALL], Ds[MAX_STAGES][SMALL]; /* lse₂, δ per column */
    __shared__ uint64_t kvbar, full[MAX_STAGES], empty[MAX_STAGES];

    const int g = blockIdx.x, b = blockIdx.y, s0 = (int)blockIdx.z * BIG;
    const int rep = a.Hq / a.Hkv;
    KvWork w;
    if (!fa_kv_work(s0, rep, a, w))
        return; /* no query sees these keys: dk, dv get nothing (uniform: before any barrier) */
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

    fa_init_barriers(&kvbar, full, empty, STAGES);
    __syncthreads();

    if (wg == 2) {
        /* ------------------------------------------------ producer (one warp) */
        setmaxnreg_dec<24>();
        if (tid < 32)
            fa_produce_q_dy<L>(tid, Ks, Vs, ring, Ls, Ds, &kvbar, full, empty, &mq, &mk, &mv,
                               &mdy, lse, delta, a, g, b, s0, rep, w);
        return;
    }

    /* ---------------------------------------------------- consumers */
    setmaxnreg_inc<240>();
    const int lane = tid % 32, wp = tid / 32;
    const int key = s0 + 64 * wg + 16 * wp + lane / 4; /* this thread's keys: key, key + 8 */
    const float sl = a.scale * LOG2E;
    const uint8_t *ka = Ks + wg * 64 * 128, *va = Vs + wg * 64 * 128; /* our 64 keys */
    float adk[D / 2], adv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        adk[i] = adv[i] = 0.0f;
    float st[32], dpt[32]; /* Sᵀ, dPᵀ: 64 keys × 64 queries per warpgroup */
    uint32_t pa[16], da[16]; /* Pᵀ, dSᵀ as A fragments */

    mbar_wait(&kvbar, 0);
    for (int it = 0; it < w.nit; it++) {
        const int s = it % STAGES, t0 = (w.qt0 + it % w.per) * SMALL;
        const uint8_t *qt = ring + s * L::STAGE, *dyt = qt + L::TILE;
        fa_tile_p_ds<D>(st, dpt, ka, va, qt, dyt, &full[s], (it / STAGES) & 1, Ls[s], Ds[s],
                        key, s0, t0, lane, a, sl);
        fa_pack_a(pa, st);
        fa_pack_a(da, dpt);
        wgmma_fence();
        fa_issue_rs<D>(adv, pa, dyt);
        fa_issue_rs<D>(adk, da, qt);
        wgmma_commit();
        wgmma_wait<0>();
        fa_release(&empty[s], lane);
    }
    fa_add_dkdv<D>(dk, dv, adk, adv, key, g, b, lane, a);
#else
    __trap(); /* sm_90a only: the host never launches it elsewhere */
#endif
}
/* ------------------------------------------------------------------ dq */

template <int D>
__global__ void __launch_bounds__(THREADS, 1)
    fa_sm90_dq_kernel(const __grid_constant__ CUtensorMap mq,
                      const __grid_constant__ CUtensorMap mk,
                      const __grid_constant__ CUtensorMap mv,
                      const __grid_constant__ CUtensorMap mdy, moe_bf16 *dq, const float *lse,
                      const float *delta, const Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef LayoutQ<D> L;
    constexpr int NC = L::NC, STAGES = L::STAGES;
    extern __shared__ uint8_t fa_smem_raw[];
    uint8_t *Qs = fa_smem_raw + ((1024 - (smem_u32(fa_smem_raw) & 1023)) & 1023);
    uint8_t *dYs = Qs + L::RES;
    uint8_t *ring = dYs + L::RES; /* stage s: K at ring + s·STAGE, V TILE bytes after it */
    __shared__ uint64_t qbar, full[MAX_STAGES], empty[MAX_STAGES];

    const int nqt = (a.Tq + BIG - 1) / BIG;
    const int h = blockIdx.x, b = blockIdx.y, t0 = (nqt - 1 - (int)blockIdx.z) * BIG;
    const int g = h / (a.Hq / a.Hkv);
    /* the keys the CTA's last row sees: [0, kend) (attention.cu's fa_key_end) */
    const long long last = (long long)min(t0 + BIG, a.Tq) - 1 + a.off;
    const int kend = last < 0 ? 0 : (int)(last + 1 < a.Tk ? last + 1 : a.Tk);
    const int nkt = (kend + SMALL - 1) / SMALL;
    if (nkt == 0)
        return; /* no row of the tile sees a key: dq gets nothing (uniform) */
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

    fa_init_barriers(&qbar, full, empty, STAGES);
    __syncthreads();

    if (wg == 2) {
        /* ------------------------------------------------ producer (one lane) */
        setmaxnreg_dec<24>();
        if (tid == 0) {
            mbar_expect_tx(&qbar, 2 * L::RES);
            for (int c = 0; c < NC; c++) {
                tma_load_4d(Qs + c * BOX_BIG, &mq, &qbar, 64 * c, h, t0, b);
                tma_load_4d(dYs + c * BOX_BIG, &mdy, &qbar, 64 * c, h, t0, b);
            }
            fa_produce_kv<STAGES, NC>(ring, L::STAGE, L::TILE, BOX_SMALL, &mk, &mv, full, empty,
                                      nkt, SMALL, g, b);
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    setmaxnreg_inc<240>();
    const int lane = tid % 32, w = tid / 32;
    const int row = t0 + 64 * wg + 16 * w + lane / 4; /* this thread's rows: row, row + 8 */
    const float sl = a.scale * LOG2E;
    float l2[2], dl[2]; /* lse₂ (0 where −∞ or past Tq) and δ of the two rows */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int t = row + 8 * i;
        const size_t at = ((size_t)b * a.Hq + h) * a.Tq + t;
        const float lt = t < a.Tq ? lse[at] : -INFINITY;
        l2[i] = lt == -INFINITY ? 0.0f : lt * LOG2E;
        dl[i] = t < a.Tq ? delta[at] : 0.0f;
    }
    const uint8_t *qa = Qs + wg * 64 * 128, *dya = dYs + wg * 64 * 128; /* our 64 rows */
    float adq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        adq[i] = 0.0f;
    float sc[32], dp[32]; /* S, dP: 64 rows × 64 keys per warpgroup */
    uint32_t da[16];      /* dS as A fragments */

    mbar_wait(&qbar, 0);
    for (int j = 0; j < nkt; j++) {
        const int s = j % STAGES, k0 = j * SMALL;
        const uint8_t *kt = ring + s * L::STAGE, *vt = kt + L::TILE;
        mbar_wait(&full[s], (j / STAGES) & 1);
        wgmma_fence();
        fa_issue_abt<D>(sc, qa, kt);
        fa_issue_abt<D>(dp, dya, vt);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < 32; i++) {
            reg_fence(sc[i]);
            reg_fence(dp[i]);
        }
        const bool mask = k0 + SMALL - 1 > t0 + a.off || k0 + SMALL > a.Tk;
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = e >> 1, kc = k0 + 8 * n + 2 * (lane % 4) + (e & 1);
                float p = exp2f(fmaf(sc[4 * n + e], sl, -l2[i]));
                if (mask && (kc > row + 8 * i + a.off || kc >= a.Tk))
                    p = 0.0f;
                dp[4 * n + e] = p * (dp[4 * n + e] - dl[i]); /* dS (without 1/√D) */
            }
        fa_pack_a(da, dp);
        wgmma_fence();
        fa_issue_rs<D>(adq, da, kt);
        wgmma_commit();
        wgmma_wait<0>();
        fa_release(&empty[s], lane);
    }
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        reg_fence(adq[i]);
    const size_t qs = (size_t)a.Hq * D;
    fa_add_rows<D>(dq + (size_t)b * a.Tq * qs + (size_t)h * D, qs, row, a.Tq, adq, a.scale,
                   lane);
#else
    __trap();
#endif
}

/* ------------------------------------------ the fused kernel (MOE_FLASH_SM90_BWD=2) */

/* The dk/dv kernel plus dq: one CTA per (b, g, key tile) computes, for each query tile that
 * sees its keys, also dS·K, and adds it to the fp32 dq accumulator acc [B, Hq, Tq, D]
 * (through the tensor map mdq) in ascending key-tile order, as the semaphores sem
 * [B, Hq, ⌈Tq/64⌉] (zero before the launch) order it. The CTA takes its tile from the
 * ticket counter (zero before the launch), not from blockIdx: a CTA only ever waits for
 * CTAs with smaller tickets, which have started, so the waits cannot deadlock whatever
 * order the hardware starts CTAs in. OVERLAP = 1 (mode 3) overlaps each consumer
 * warpgroup's arithmetic with its own wgmmas (the header's "Mode 3"); the products, their
 * operands and the accumulation orders are mode 2's. NONDET = 1 (mode 4, with OVERLAP = 0)
 * drops the semaphores: every dq tile is a TMA reduce-add into acc (zeroed before the
 * launch) in whatever order the CTAs reach it (the header's "Mode 4"); sem is not read.
 * NONDET = 2 (mode 5): mode 4 with the batched dk/dv epilogue (fa_add_dkdv<D, true>).
 * OVERLAP = 2 (mode 6; with NONDET = 1 mode 7): FlashAttention-3's order of the products and
 * waits, dq staged under dK, a dq hand-off per warpgroup (the header's "Mode 6"). */
template <int D, int OVERLAP, int NONDET>
__global__ void __launch_bounds__(THREADS, 1)
    fa_sm90_fused_kernel(const __grid_constant__ CUtensorMap mq,
                         const __grid_constant__ CUtensorMap mk,
                         const __grid_constant__ CUtensorMap mv,
                         const __grid_constant__ CUtensorMap mdy,
                         const __grid_constant__ CUtensorMap mdq, moe_bf16 *dk, moe_bf16 *dv,
                         const float *lse, const float *delta, int *sem, int *ticket,
                         const Args a, const int B) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef LayoutFused<D> L;
    constexpr int STAGES = L::STAGES, NP = L::NP;
    extern __shared__ uint8_t fa_smem_raw[];
    uint8_t *Ks = fa_smem_raw + ((1024 - (smem_u32(fa_smem_raw) & 1023)) & 1023);
    uint8_t *Vs = Ks + L::RES;
    uint8_t *ring = Vs + L::RES;              /* as the dk/dv kernel's */
    uint8_t *dsb = ring + STAGES * L::STAGE;  /* dS, two copies */
    uint8_t *dqs = dsb + 2 * L::DS;           /* the dq staging buffer */
    __shared__ float Ls[MAX_STAGES][SMALL], Ds[MAX_STAGES][SMALL]; /* lse₂, δ per column */
    __shared__ uint64_t kvbar, full[MAX_STAGES], empty[MAX_STAGES];
    __shared__ int tile;

    if (threadIdx.x == 0)
        tile = atomicAdd(ticket, 1);
    fa_init_barriers(&kvbar, full, empty, STAGES);
    __syncthreads();
    /* the key tile is the slowest index: all (b, g) of key tile 0 first (the most query
     * tiles see it), and the tile a CTA waits for (j − 1) has a smaller ticket (mode 4
     * waits for nobody: there the ticket only starts the heaviest CTAs first) */
    const int j = tile / (a.Hkv * B), g = tile % a.Hkv, b = (tile / a.Hkv) % B;
    const int s0 = j * BIG, rep = a.Hq / a.Hkv;
    KvWork w;
    if (!fa_kv_work(s0, rep, a, w))
        return; /* no query sees these keys, nor those of the later key tiles: nobody waits
                   for this CTA (uniform) */
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

    if (wg == 2) {
        /* ------------------------------- producer (warp 0) and dq store warp (warp 1) */
        setmaxnreg_dec<24>();
        if (tid < 32)
            fa_produce_q_dy<L>(tid, Ks, Vs, ring, Ls, Ds, &kvbar, full, empty, &mq, &mk, &mv,
                               &mdy, lse, delta, a, g, b, s0, rep, w);
        else if (tid < 64)
            fa_store_dq<NP, NONDET, OVERLAP == 2>(tid - 32, &mdq, dqs, sem, j, g, b, rep, w, a);
        return;
    }

    /* ---------------------------------------------------- consumers */
    setmaxnreg_inc<240>();
    const int lane = tid % 32, wp = tid / 32;
    const int row = 64 * wg + 16 * wp + lane / 4; /* this thread's rows of the key tile */
    const int key = s0 + row;                     /* its keys: key, key + 8 */
    const float sl = a.scale * LOG2E;
    const uint8_t *ka = Ks + wg * 64 * 128, *va = Vs + wg * 64 * 128; /* our 64 keys */
    /* D = 64: warpgroup 0 computes all of dq's 64 columns (the warpgroups share the tensor
     * cores, so the other one's idle turn costs little); the shuffle makes the condition
     * visibly warp-uniform to ptxas, which otherwise serialises the wgmma in the branch */
    const bool dq_part = NP == 2 || __shfl_sync(0xffffffffu, wg, 0) == 0;
    float adk[D / 2], adv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        adk[i] = adv[i] = 0.0f;
    float st[32], dpt[32]; /* Sᵀ, dPᵀ: 64 keys × 64 queries per warpgroup; then st = dQ */
    uint32_t pa[16], da[16]; /* Pᵀ, dSᵀ as A fragments */

    mbar_wait(&kvbar, 0);
    if constexpr (OVERLAP == 2) {
        /* Modes 6, 7: FlashAttention-3's order (the header's "Mode 6"); five commit groups,
         * waited for one at a time, all done at the end of the iteration (no group pending
         * at the loop's head on any path, so ptxas need not serialise the wgmmas). */
        for (int it = 0; it < w.nit; it++) {
            const int s = it % STAGES, t0 = (w.qt0 + it % w.per) * SMALL;
            const uint8_t *qt = ring + s * L::STAGE, *dyt = qt + L::TILE;
            uint8_t *ds = dsb + (it & 1) * L::DS;
            mbar_wait(&full[s], (it / STAGES) & 1);
            wgmma_fence();
            fa_issue_abt<D>(st, ka, qt);
            wgmma_commit();
            fa_issue_abt<D>(dpt, va, dyt);
            wgmma_commit();
            wgmma_wait<1>(); /* Sᵀ (dPᵀ runs on) */
            fa_tile_p(st, Ls[s], key, s0, t0, lane, a, sl);
            wgmma_wait<0>(); /* dPᵀ */
            fa_tile_ds(dpt, st, Ds[s], lane);
            fa_pack_a(pa, st);
            fa_pack_a(da, dpt);
            fa_store_ds(ds, da, row, lane);
            fence_proxy_async(); /* our stores → wgmma's reads */
            wgmma_fence();
            fa_issue_rs<D>(adv, pa, dyt);
            wgmma_commit();
            /* both warpgroups' dS rows are written (the double buffer: the header's "Mode 6") */
            named_bar_sync(BAR_DS, 256);
            if (dq_part) {
                wgmma_fence();
                fa_issue_dq(st, ds, Ks + wg * BOX_BIG);
                wgmma_commit();
                wgmma_wait<1>(); /* dV (dQ runs on) */
                wgmma_fence(); /* as FlashAttention-3 before each product (no register of dK's
                                  was touched since the last fence: cheap insurance) */
                fa_issue_rs<D>(adk, da, qt);
                wgmma_commit();
                wgmma_wait<1>(); /* dQ (dK runs on): stage it for the store warp meanwhile */
                fa_stage_dq<NP, true>(st, dqs + wg * L::PART, tid, wg);
                wgmma_wait<0>(); /* dK: done with the stage */
                fa_release(&empty[s], lane);
            } else {
                wgmma_fence();
                fa_issue_rs<D>(adk, da, qt);
                wgmma_commit();
                wgmma_wait<0>();
                fa_release(&empty[s], lane);
            }
        }
    } else if constexpr (OVERLAP) {
        /* Mode 3: the iteration's products in four commit groups, waited for one by one,
         * so that each piece of arithmetic runs under a wgmma of this warpgroup (the other
         * warpgroup's come on top, as in mode 2):
         *
         *   issue Sᵀ, dPᵀ      wait for all but dPᵀ: Pᵀ while dPᵀ runs
         *   issue dV += Pᵀ dY  wait for all but dV: dSᵀ while dV runs; dS → shared memory
         *   issue dK += dSᵀ Q; barrier 1; issue dQ = dS K; wait for all but dQ: release the
         *   stage while dQ runs; wait for dQ and stage it (as mode 2)
         *
         * Registers (D = 128): the peak is during dSᵀ, adk + adv + st + dpt + pa = 208, as in
         * mode 2. Carrying dQ in flight into the next iteration (its staging under the next
         * Sᵀ) was tried: ptxas (nvcc 13) then serialises every wgmma of the kernel (C7514),
         * as it does where the number of pending groups at the loop's head depends on the
         * path. */
        for (int it = 0; it < w.nit; it++) {
            const int s = it % STAGES, t0 = (w.qt0 + it % w.per) * SMALL;
            const uint8_t *qt = ring + s * L::STAGE, *dyt = qt + L::TILE;
            uint8_t *ds = dsb + (it & 1) * L::DS;
            mbar_wait(&full[s], (it / STAGES) & 1);
            wgmma_fence();
            fa_issue_abt<D>(st, ka, qt);
            wgmma_commit();
            fa_issue_abt<D>(dpt, va, dyt);
            wgmma_commit();
            wgmma_wait<1>(); /* Sᵀ (dPᵀ runs on) */
            fa_tile_p(st, Ls[s], key, s0, t0, lane, a, sl);
            fa_pack_a(pa, st);
            wgmma_fence();
            fa_issue_rs<D>(adv, pa, dyt);
            wgmma_commit();
            wgmma_wait<1>(); /* dPᵀ (dV runs on) */
            fa_tile_ds(dpt, st, Ds[s], lane);
            fa_pack_a(da, dpt);
            fa_store_ds(ds, da, row, lane);
            fence_proxy_async(); /* our stores → wgmma's reads */
            wgmma_fence();
            fa_issue_rs<D>(adk, da, qt);
            wgmma_commit();
            named_bar_sync(BAR_DS, 256); /* both warpgroups' dS rows are written */
            if (dq_part) {
                wgmma_fence();
                fa_issue_dq(st, ds, Ks + wg * BOX_BIG);
                wgmma_commit();
                wgmma_wait<1>(); /* dV, dK: done with the stage (dQ runs on) */
                fa_release(&empty[s], lane);
                wgmma_wait<0>();
                fa_stage_dq<NP>(st, dqs + wg * L::PART, tid);
            } else {
                wgmma_wait<0>();
                fa_release(&empty[s], lane);
            }
        }
    } else {
        for (int it = 0; it < w.nit; it++) {
            const int s = it % STAGES, t0 = (w.qt0 + it % w.per) * SMALL;
            const uint8_t *qt = ring + s * L::STAGE, *dyt = qt + L::TILE;
            uint8_t *ds = dsb + (it & 1) * L::DS;
            fa_tile_p_ds<D>(st, dpt, ka, va, qt, dyt, &full[s], (it / STAGES) & 1, Ls[s], Ds[s],
                            key, s0, t0, lane, a, sl);
            fa_pack_a(pa, st);
            fa_pack_a(da, dpt);
            /* dSᵀ to shared memory, for the dq product (which needs dS with the queries as
             * rows, across both warpgroups' keys) */
            fa_store_ds(ds, da, row, lane);
            fence_proxy_async(); /* our stores → wgmma's reads */
            wgmma_fence();
            fa_issue_rs<D>(adv, pa, dyt);
            fa_issue_rs<D>(adk, da, qt);
            wgmma_commit();
            /* both warpgroups' dS rows are written; the copy written now was last read by the
             * dq products of iteration it − 2, which both warpgroups waited for before they
             * reached this barrier in iteration it − 1 */
            named_bar_sync(BAR_DS, 256);
            if (dq_part) {
                wgmma_fence();
                fa_issue_dq(st, ds, Ks + wg * BOX_BIG);
                wgmma_commit();
                wgmma_wait<1>(); /* dV, dK: done with the stage */
                fa_release(&empty[s], lane);
                wgmma_wait<0>();
                fa_stage_dq<NP>(st, dqs + wg * L::PART, tid);
            } else {
                wgmma_wait<0>();
                fa_release(&empty[s], lane);
            }
        }
    }
    if constexpr (NONDET == 2)
        fa_add_dkdv<D, true>(dk, dv, adk, adv, key, g, b, lane, a);
    else
        fa_add_dkdv<D>(dk, dv, adk, adv, key, g, b, lane, a);
#else
    __trap();
#endif
}

/* dq[b, t, h, c .. c + 7] += scale · acc[row, c .. c + 7] for row = (b·Hq + h)·Tq + t
 * (bf16 += fp32, one rounding): what both add kernels do for one thread. */
__device__ __forceinline__ void fa_dq_add8(moe_bf16 *dq, const float *acc, size_t row, int c,
                                           int t, size_t bh, int Hq, int Tq, int D,
                                           float scale) {
    const int b = (int)(bh / Hq), h = (int)(bh % Hq);
    const float4 *x = reinterpret_cast<const float4 *>(acc + row * D + c);
    const float4 x0 = x[0], x1 = x[1];
    uint4 *o = reinterpret_cast<uint4 *>(dq + (((size_t)b * Tq + t) * Hq + h) * D + c);
    uint4 old = *o;
    __nv_bfloat162 *v = reinterpret_cast<__nv_bfloat162 *>(&old);
    const float add[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        v[i] = __floats2bfloat162_rn(__low2float(v[i]) + add[2 * i] * scale,
                                     __high2float(v[i]) + add[2 * i + 1] * scale);
    *o = old;
}

/* dq[b, t, h, :] += scale · acc[b, h, t, :] (bf16 += fp32, one rounding) for the rows of the
 * query tiles that some key tile reached (semaphore > 0: the others' acc was never
 * written); one thread per 8 columns. */
__global__ void fa_sm90_dq_add_kernel(moe_bf16 *dq, const float *acc, const int *sem, int B,
                                      int Tq, int Hq, int D, float scale) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int c8 = D / 8;
    if (idx >= (size_t)B * Hq * Tq * c8)
        return;
    const size_t row = idx / c8; /* (b·Hq + h)·Tq + t */
    const int c = (int)(idx % c8) * 8, t = (int)(row % Tq);
    const size_t bh = row / Tq;
    if (sem[bh * ((Tq + SMALL - 1) / SMALL) + t / SMALL] == 0)
        return;
    fa_dq_add8(dq, acc, row, c, t, bh, Hq, Tq, D, scale);
}

/* Mode 4's: the same for every row, with no semaphores to say which tiles were reached: acc
 * was zeroed before the fused kernel, and a row that sees no key gets only zeros from the
 * key tiles that reach its tile (its P, hence its dS, is masked to 0) and nothing where no
 * key tile reaches it, so its acc is +0 and dq + 0 = dq (bit for bit but for a dq of −0,
 * which becomes +0: the same value). */
__global__ void fa_sm90_dq_add_all_kernel(moe_bf16 *dq, const float *acc, int B, int Tq, int Hq,
                                          int D, float scale) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int c8 = D / 8;
    if (idx >= (size_t)B * Hq * Tq * c8)
        return;
    const size_t row = idx / c8; /* (b·Hq + h)·Tq + t */
    fa_dq_add8(dq, acc, row, (int)(idx % c8) * 8, (int)(row % Tq), row / Tq, Hq, Tq, D, scale);
}

/* ---------------------------------------------------------------- host side */

/* MOE_FLASH_SM90_BWD: unset or 6 = the fused kernel in FlashAttention-3's order of the
 * header's "Mode 6" (the default since 3553226: mode 2's bits, and on an H100 1.02-1.05x mode
 * 2 at 4K-32K, D = 128, 1.00x at D = 64), 2 = the fused kernel in its first order (on an H100
 * the same bits as mode 1 on the tests' shapes and 1.17x its speed at 16K, D = 128, 1.57x at
 * D = 64), 3 = the
 * fused kernel with the overlap of the header's "Mode 3" (mode 2's bits; measured slower, so
 * opt-in), 4 = the fused kernel without the semaphores (the header's "Mode 4":
 * NON-deterministic dq; 1.05x mode 2, opt-in and never the default), 5 = mode 4 with
 * the batched dk/dv epilogue of the header's "Mode 5" (not deterministic either), 7 = mode 6
 * without the semaphores (NOT deterministic; 1.04-1.10x mode 2, opt-in), 1 = the
 * Hopper backward's two kernels, 0 = the portable backward; read at every call (a getenv), so that
 * one process (the tests, the benchmark) can switch. */
int fa_sm90_bwd_mode(void) {
    const char *e = getenv("MOE_FLASH_SM90_BWD");
    if (!e)
        return 6;
    if (strcmp(e, "0") && strcmp(e, "1") && strcmp(e, "2") && strcmp(e, "3") &&
        strcmp(e, "4") && strcmp(e, "5") && strcmp(e, "6") && strcmp(e, "7")) {
        fprintf(stderr, "MOE_FLASH_SM90_BWD=%s: must be 6 (the Hopper backward of "
                        "kernels/attention_sm90_bwd.cu, sm_90 only, its fused single kernel "
                        "with a deterministic fp32 dq reduction, in FlashAttention-3's order "
                        "inside an iteration: the default), 2 (the same kernel in its first "
                        "order, mode 6's bits), 3 (the same "
                        "kernel with its wgmmas overlapped with the arithmetic, mode 2's bits), "
                        "4 (the fused kernel with unordered dq reduce-adds: NOT deterministic), "
                        "5 (mode 4 with its dk/dv epilogue's loads batched), "
                        "7 (mode 6 with unordered dq reduce-adds: NOT "
                        "deterministic), "
                        "1 (its two kernels) or 0 (the portable flash-attention backward)\n",
                e);
        exit(1);
    }
    return e[0] - '0';
}

long long g_sm90_bwd_calls = 0, g_sm90_bwd_fused_calls = 0, g_sm90_bwd_overlap_calls = 0,
          g_sm90_bwd_nondet_calls = 0, g_sm90_bwd_batched_calls = 0,
          g_sm90_bwd_fa3order_calls = 0;

/* The dk/dv side's tensor maps (both modes): K and V resident in boxes of 128 rows, Q and
 * dY streamed in boxes of 64. */
struct KvMaps {
    CUtensorMap q, k, v, dy;
};
KvMaps fa_kv_maps(const void *q, const void *k, const void *v, const void *dy,
                  moe_attention_shape s) {
    KvMaps m;
    m.k = fa_sm90_map(k, s.B, s.Tk, s.Hkv, s.D, BIG);
    m.v = fa_sm90_map(v, s.B, s.Tk, s.Hkv, s.D, BIG);
    m.q = fa_sm90_map(q, s.B, s.Tq, s.Hq, s.D, SMALL);
    m.dy = fa_sm90_map(dy, s.B, s.Tq, s.Hq, s.D, SMALL);
    return m;
}

Args fa_args(moe_attention_shape s) {
    Args a;
    a.Tq = s.Tq;
    a.Tk = s.Tk;
    a.Hq = s.Hq;
    a.Hkv = s.Hkv;
    a.off = s.q_pos - s.k_pos;
    a.scale = (float)(1.0 / sqrt((double)s.D));
    return a;
}

template <int D>
void fa_sm90_bwd_launch(moe_bf16 *dq, moe_bf16 *dk, moe_bf16 *dv, const void *dy,
                        const float *lse, const float *delta, const void *q, const void *k,
                        const void *v, moe_attention_shape s) {
    moe_cuda_smem_opt_in<fa_sm90_dkdv_kernel<D>>(LayoutKV<D>::BYTES);
    moe_cuda_smem_opt_in<fa_sm90_dq_kernel<D>>(LayoutQ<D>::BYTES);
    const Args a = fa_args(s);
    const KvMaps m = fa_kv_maps(q, k, v, dy, s);
    const dim3 gkv((unsigned)s.Hkv, (unsigned)s.B, (unsigned)((s.Tk + BIG - 1) / BIG));
    fa_sm90_dkdv_kernel<D><<<gkv, THREADS, LayoutKV<D>::BYTES, moe_cuda_stream()>>>(
        m.q, m.k, m.v, m.dy, dk, dv, lse, delta, a);
    MOE_CUDA_LAUNCH_CHECK();

    const CUtensorMap mq_big = fa_sm90_map(q, s.B, s.Tq, s.Hq, D, BIG);
    const CUtensorMap mdy_big = fa_sm90_map(dy, s.B, s.Tq, s.Hq, D, BIG);
    const CUtensorMap mk_small = fa_sm90_map(k, s.B, s.Tk, s.Hkv, D, SMALL);
    const CUtensorMap mv_small = fa_sm90_map(v, s.B, s.Tk, s.Hkv, D, SMALL);
    const dim3 gq((unsigned)s.Hq, (unsigned)s.B, (unsigned)((s.Tq + BIG - 1) / BIG));
    fa_sm90_dq_kernel<D><<<gq, THREADS, LayoutQ<D>::BYTES, moe_cuda_stream()>>>(
        mq_big, mk_small, mv_small, mdy_big, dq, lse, delta, a);
    MOE_CUDA_LAUNCH_CHECK();
}

/* The fused backward: its workspace is the scratch slot MOE_SCRATCH_ATTENTION_DQ (grown in
 * the first call of a shape, so never inside a CUDA graph capture: lib/graph.c runs a region
 * eagerly before it captures it): the semaphores and the ticket counter, zeroed here on the
 * op's stream (a memset node when captured), then the fp32 accumulator [B, Hq, Tq, D],
 * which needs no zeroing (key tile 0 stores, the others add; the add kernel skips the tiles
 * that no key tile reached). OVERLAP: mode 3's kernel (1), mode 6's (2: FlashAttention-3's
 * order, with NONDET = 1 mode 7) or mode 2's (0). NONDET (mode 4):
 * every key tile reduce-adds, so acc is zeroed too (the same memset, over the whole
 * workspace), and the add kernel takes every row; NONDET = 2 (mode 5): the same with the
 * kernel's batched dk/dv epilogue. */
template <int D, int OVERLAP, int NONDET>
void fa_sm90_fused_launch(moe_bf16 *dq, moe_bf16 *dk, moe_bf16 *dv, const void *dy,
                          const float *lse, const float *delta, const void *q, const void *k,
                          const void *v, moe_attention_shape s) {
    typedef LayoutFused<D> L;
    moe_cuda_smem_opt_in<fa_sm90_fused_kernel<D, OVERLAP, NONDET>>(L::BYTES);
    const Args a = fa_args(s);
    const size_t nsem = (size_t)s.B * s.Hq * ((s.Tq + SMALL - 1) / SMALL);
    const size_t sem_bytes = ((nsem + 1) * sizeof(int) + 255) / 256 * 256; /* + the ticket */
    const size_t nacc = (size_t)s.B * s.Hq * s.Tq * D;
    uint8_t *ws = (uint8_t *)moe_cuda_scratch(MOE_SCRATCH_ATTENTION_DQ,
                                              sem_bytes + nacc * sizeof(float));
    int *sem = (int *)ws, *ticket = sem + nsem;
    float *acc = (float *)(ws + sem_bytes);
    MOE_CUDA_CHECK(cudaMemsetAsync(sem, 0, NONDET ? sem_bytes + nacc * sizeof(float)
                                                  : (nsem + 1) * sizeof(int),
                                   moe_cuda_stream()));

    const KvMaps m = fa_kv_maps(q, k, v, dy, s);
    const uint64_t dims[3] = {(uint64_t)D, (uint64_t)s.Tq, (uint64_t)s.B * s.Hq};
    const uint32_t box[3] = {32, SMALL, 1}; /* [64 rows][32 fp32]: 128 bytes a row */
    const CUtensorMap mdq = moe_tma_map(acc, 3, dims, box, MOE_TMA_F32);
    const unsigned ctas = (unsigned)s.Hkv * s.B * ((s.Tk + BIG - 1) / BIG);
    fa_sm90_fused_kernel<D, OVERLAP, NONDET><<<ctas, THREADS, L::BYTES, moe_cuda_stream()>>>(
        m.q, m.k, m.v, m.dy, mdq, dk, dv, lse, delta, sem, ticket, a, s.B);
    MOE_CUDA_LAUNCH_CHECK();
    if (NONDET)
        fa_sm90_dq_add_all_kernel<<<moe_cdiv(nacc / 8, 256), 256, 0, moe_cuda_stream()>>>(
            dq, acc, s.B, s.Tq, s.Hq, D, a.scale);
    else
        fa_sm90_dq_add_kernel<<<moe_cdiv(nacc / 8, 256), 256, 0, moe_cuda_stream()>>>(
            dq, acc, sem, s.B, s.Tq, s.Hq, D, a.scale);
    MOE_CUDA_LAUNCH_CHECK();
}

} // namespace

extern "C" int moe_cuda_attention_sm90_backward(void *dq, void *dk, void *dv, const void *dy,
                                                const moe_real *lse, const moe_real *delta,
                                                const void *q, const void *k, const void *v,
                                                moe_attention_shape s) {
    const int mode = fa_sm90_bwd_mode();
    if (!mode || (s.D != 64 && s.D != 128) || s.B < 1 || s.Tq < 1 || s.Tk < 1 ||
        s.B > 65535 || (s.Tq + BIG - 1) / BIG > 65535 || (s.Tk + BIG - 1) / BIG > 65535 ||
        (long long)s.Hkv * s.B * ((s.Tk + BIG - 1) / BIG) > 0x7fffffff || !fa_sm90_device())
        return 0;
    if (!fa_aligned16(dq) || !fa_aligned16(dk) || !fa_aligned16(dv) || !fa_aligned16(dy) ||
        !fa_aligned16(q) || !fa_aligned16(k) || !fa_aligned16(v))
        return 0; /* TMA needs 16-byte aligned tensors; the epilogue 4-byte pairs */
    moe_bf16 *dQ = (moe_bf16 *)dq, *dK = (moe_bf16 *)dk, *dV = (moe_bf16 *)dv;
    if (mode == 2 && s.D == 64)
        fa_sm90_fused_launch<64, 0, 0>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (mode == 2)
        fa_sm90_fused_launch<128, 0, 0>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (mode == 3 && s.D == 64)
        fa_sm90_fused_launch<64, 1, 0>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (mode == 3)
        fa_sm90_fused_launch<128, 1, 0>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (mode == 4 && s.D == 64)
        fa_sm90_fused_launch<64, 0, 1>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (mode == 4)
        fa_sm90_fused_launch<128, 0, 1>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (mode == 5 && s.D == 64)
        fa_sm90_fused_launch<64, 0, 2>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (mode == 5)
        fa_sm90_fused_launch<128, 0, 2>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (mode == 6 && s.D == 64)
        fa_sm90_fused_launch<64, 2, 0>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (mode == 6)
        fa_sm90_fused_launch<128, 2, 0>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (mode == 7 && s.D == 64)
        fa_sm90_fused_launch<64, 2, 1>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (mode == 7)
        fa_sm90_fused_launch<128, 2, 1>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else if (s.D == 64)
        fa_sm90_bwd_launch<64>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    else
        fa_sm90_bwd_launch<128>(dQ, dK, dV, dy, lse, delta, q, k, v, s);
    g_sm90_bwd_calls++;
    g_sm90_bwd_fused_calls += mode >= 2;
    g_sm90_bwd_overlap_calls += mode == 3;
    g_sm90_bwd_nondet_calls += mode == 4 || mode == 5 || mode == 7;
    g_sm90_bwd_batched_calls += mode == 5;
    g_sm90_bwd_fa3order_calls += mode >= 6;
    return 1;
}

extern "C" long long moe_cuda_attention_sm90_backward_calls(void) { return g_sm90_bwd_calls; }

extern "C" long long moe_cuda_attention_sm90_backward_fused_calls(void) {
    return g_sm90_bwd_fused_calls;
}

extern "C" long long moe_cuda_attention_sm90_backward_overlap_calls(void) {
    return g_sm90_bwd_overlap_calls;
}

extern "C" long long moe_cuda_attention_sm90_backward_nondet_calls(void) {
    return g_sm90_bwd_nondet_calls;
}

extern "C" long long moe_cuda_attention_sm90_backward_batched_calls(void) {
    return g_sm90_bwd_batched_calls;
}

extern "C" long long moe_cuda_attention_sm90_backward_fa3order_calls(void) {
    return g_sm90_bwd_fa3order_calls;
}
