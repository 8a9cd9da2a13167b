/* Context-parallel attention (chapter 07): see context_parallel.h. */
#include "context_parallel.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

moe_status moe_cp_attention_supported(const moe_backend *be, moe_error *err) {
    /* besides the attention op and the communicator: the merge, the lse fill and the strided
     * copies of the all-to-alls, all on backend memory (the CPU's and the CUDA tables have
     * them) */
    if (be->cp_merge && be->fill_real && be->copy_2d)
        return MOE_OK;
    return moe_error_set(err, MOE_ERR_CONFIG,
                         "--context-parallel-size > 1 on the %s backend: its op table has no "
                         "cp_merge, fill_real or copy_2d op (the merge of the partial results "
                         "by their log-sum-exp and the all-to-all's packing); use --device cpu "
                         "or cuda", be->name);
}

/* The ring's buffers (p2p, a2a+p2p), in units of KL (one rank's keys or values): the held
 * and the next [k | v] (2 + 2), two [dk | dv] accumulators (2 + 2: the one being filled,
 * the one travelling on) and the partial sums arriving from the previous rank (2). */
#define RING_KLS 10

/* Element counts of one rank's tensors: a chunk of B sequences of queries (QC) and of
 * keys (KC), lse rows of a chunk (LC), and a rank's keys or values, both chunks (KL). */
typedef struct sizes {
    int C;
    size_t QC, KC, LC, KL;
} sizes;

static sizes sizes_of(const moe_cp_attention *a) {
    sizes z;
    z.C = a->T / (2 * a->cp);
    z.QC = (size_t)a->B * z.C * a->Hq * a->D;
    z.KC = (size_t)a->B * z.C * a->Hkv * a->D;
    z.LC = (size_t)a->B * a->Hq * z.C;
    z.KL = 2 * z.KC;
    return z;
}

moe_status moe_cp_attention_check(const moe_cp_attention *a, moe_error *err) {
    MOE_TRY(moe_cp_check(a->T, a->cp, err));
    if (a->type == MOE_CP_A2A_P2P &&
        (a->a2a < 1 || a->cp % a->a2a != 0 || a->Hq % a->a2a != 0 || a->Hkv % a->a2a != 0))
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--cp-comm-type a2a+p2p with an all-to-all group of %d ranks: it "
                             "must divide --context-parallel-size %d, --num-attention-heads %d "
                             "and --num-query-groups %d", a->a2a, a->cp, a->Hq, a->Hkv);
    if (a->type == MOE_CP_A2A && (a->Hq % a->cp != 0 || a->Hkv % a->cp != 0))
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--cp-comm-type a2a splits the heads over the %d context-parallel "
                             "ranks, but --num-attention-heads %d and --num-query-groups %d do "
                             "not both divide by %d: use --cp-comm-type p2p or allgather, or "
                             "another --context-parallel-size", a->cp, a->Hq, a->Hkv, a->cp);
    return MOE_OK;
}

/* Query rows of a type's largest attention op call: a block of C rows of every head, a2a's
 * whole sequence of its Hq/cp heads, a2a+p2p's block of its Hq/a2a heads. */
static size_t op_rows(const moe_cp_attention *a) {
    const sizes z = sizes_of(a);
    if (a->type == MOE_CP_A2A)
        return 2 * z.LC;
    if (a->type == MOE_CP_A2A_P2P)
        return z.LC / (size_t)a->a2a;
    return z.LC;
}

/* the exchange's own buffers (the layouts below) */
static size_t exchange_bytes(const moe_cp_attention *a, size_t act_size) {
    const sizes z = sizes_of(a);
    if (a->type == MOE_CP_A2A_P2P) /* q y dy dq blocks, the ring's buffers, lse, parts */
        return (5 * 2 * z.QC + RING_KLS * z.KL) * act_size + 2 * z.LC * sizeof(moe_real) +
               z.QC / (size_t)a->a2a * act_size + z.LC / (size_t)a->a2a * sizeof(moe_real) + 16;
    if (a->type == MOE_CP_A2A) /* q k v y dy dq dk dv of my heads, their lse, the staging */
        return (4 * 2 * z.QC + 4 * z.KL + 2 * 2 * z.QC) * act_size + 2 * z.LC * sizeof(moe_real);
    /* one partial lse and y, the y at 16 bytes (+ 16: the attention op's vector stores) */
    const size_t part = z.LC * sizeof(moe_real) + 16 + z.QC * act_size;
    if (a->type == MOE_CP_ALLGATHER) /* all keys and values, their gradients, one piece */
        return (4 * (size_t)a->cp * z.KL + z.KL) * act_size + part;
    return RING_KLS * z.KL * act_size + part; /* the ring's buffers */
}

static size_t align16(size_t n) { return (n + 15) / 16 * 16; }

/* p, moved on to the next multiple of 16 bytes from the workspace's start */
static void *at16(void *ws, void *p) {
    return (char *)ws + align16((size_t)((char *)p - (char *)ws));
}

/* After the exchange's buffers: the attention op's workspace, one fp32 per query row of the
 * largest call (what the CUDA op keeps there, the backward's row dots δ; the CPU's needs
 * none), shared by every block: the forward leaves nothing there for the backward (both
 * backends' contract), and the backward of a block writes it before it reads it. */
size_t moe_cp_attention_workspace_bytes(const moe_cp_attention *a, size_t act_size) {
    return align16(exchange_bytes(a, act_size)) + op_rows(a) * sizeof(float);
}

/* the op's workspace for a call of shape `s` (NULL when it needs none) */
static void *op_ws(const moe_backend *be, const moe_cp_attention *a, void *ws,
                   moe_attention_shape s) {
    const size_t need = be->attention_workspace_bytes(s);
    if (need == 0)
        return NULL;
    MOE_ASSERT(need <= op_rows(a) * sizeof(float)); /* more than one fp32 a row: resize */
    return (char *)ws + align16(exchange_bytes(a, be->act_size));
}

/* The shape of one block: query chunk `qc` of this rank against key chunk `kc`, global
 * chunk indices (their absolute positions give the causal mask). */
static moe_attention_shape block(const moe_cp_attention *a, int qc, int kc) {
    const int C = a->T / (2 * a->cp);
    moe_attention_shape s = {a->B, C, C, a->Hq, a->Hkv, a->D, qc * C, kc * C};
    return s;
}

/* ------------------------------------------------------------ the ring (p2p, a2a+p2p) */

typedef struct ring_bufs {
    char *kv[2], *acc[2], *in;
} ring_bufs;

static ring_bufs ring_layout(char *p, size_t kl_bytes) {
    ring_bufs r = {{p, p + 2 * kl_bytes}, {p + 4 * kl_bytes, p + 6 * kl_bytes}, p + 8 * kl_bytes};
    return r;
}

/* The blocks of ring step `step`: this rank's queries against the held keys and values
 * `kv` ([k | v]); forward they merge into the output, backward they add into dq and into
 * `dkv` ([dk | dv] of the held keys). */
typedef void (*ring_blocks)(const moe_backend *be, const moe_cp_attention *a, const void *ctx,
                            int step, const char *kv, char *dkv);

/* Hops smaller than this are not overlapped by default: measured on 2 H100s (chapter 07's
 * results), the overlap gains 4-6% of the attention at 8K-16K tokens (32-64 MiB hops) but
 * the GPU preset (2 MiB hops, a host-bound step) lost 1 ms of its 8 to the side stream's
 * events and the extra exchange of the backward. */
#define RING_OVERLAP_MIN_BYTES ((size_t)8 << 20)

/* Whether the ring overlaps hops of `bytes`: MOE_CP_RING_OVERLAP=1 always, =0 never (the
 * baseline: every hop completes before the blocks after it are enqueued), unset: from
 * RING_OVERLAP_MIN_BYTES up. Every choice gives the same bits (tests/mpi_cp.c). */
static int ring_overlap(size_t bytes) {
    const char *v = getenv("MOE_CP_RING_OVERLAP");
    if (v && (!strcmp(v, "0") || !strcmp(v, "1")))
        return v[0] == '1';
    return bytes >= RING_OVERLAP_MIN_BYTES;
}

/* Pass `count` elements of `cur` to the next rank of ring `comm` (n ranks, this one `me`)
 * and receive the previous rank's into `nxt`: one exchange, so there is no order of sends
 * and receives to get wrong. Overlapped: started here, and the returned handle finishes
 * it; else complete on return (on the compute stream) and -1. */
static int ring_start(const moe_backend *be, moe_comm *comm, int me, int n, const void *cur,
                      void *nxt, size_t count, int overlap) {
    const moe_comm_chunk to = {0, count, (me + 1) % n};
    const moe_comm_chunk from = {0, count, (me + n - 1) % n};
    if (overlap)
        return moe_comm_exchange_start(comm, cur, &to, 1, nxt, &from, 1, moe_dtype_act(be));
    moe_comm_exchange(comm, cur, &to, 1, nxt, &from, 1, moe_dtype_act(be));
    return -1;
}

/* The forward ring: n steps; at each, the next keys and values are already on their way
 * while the held ones are used (the hop is started before the blocks and finished after). */
static void ring_forward(const moe_backend *be, const moe_cp_attention *a, moe_comm *comm,
                         int me, int n, const ring_bufs *r, ring_blocks blocks, const void *ctx) {
    const size_t kv_count = 2 * sizes_of(a).KL;
    const int overlap = ring_overlap(kv_count * be->act_size);
    char *kv[2] = {r->kv[0], r->kv[1]};
    for (int i = 0; i < n; i++) {
        const int h = i + 1 < n ? ring_start(be, comm, me, n, kv[0], kv[1], kv_count, overlap)
                                : -1;
        blocks(be, a, ctx, i, kv[0], NULL);
        moe_comm_exchange_finish(comm, h);
        char *t = kv[0];
        kv[0] = kv[1], kv[1] = t;
    }
}

/* The backward ring; returns the [dk | dv] of this rank's own keys and values.
 *
 * The keys and values travel as in the forward, overlapped with the blocks. Their gradient
 * is a sum over the ranks that visit them: the partial sum of source s leaves s at step 0
 * and reaches rank s − 1 at step n − 1, one hop per step, and one more hop brings it home.
 * A rank cannot add into the partial sum it is receiving before it has arrived, so to keep
 * the hop off the critical path each step computes its blocks into a zeroed accumulator
 * while the partial sum arrives, then adds it (one more pass over 2·KL elements) and starts
 * sending the total on, which then overlaps the next step's blocks. Two accumulators
 * alternate: the one sent at step i is in flight until step i + 1 finishes it. */
static char *ring_backward(const moe_backend *be, const moe_cp_attention *a, moe_comm *comm,
                           int me, int n, const ring_bufs *r, ring_blocks blocks,
                           const void *ctx) {
    const size_t kv_count = 2 * sizes_of(a).KL;
    const int overlap = ring_overlap(kv_count * be->act_size);
    char *kv[2] = {r->kv[0], r->kv[1]};
    int hd = -1; /* the accumulator travelling on */
    for (int i = 0; i < n; i++) {
        char *acc = r->acc[i % 2];
        const int hk = i + 1 < n ? ring_start(be, comm, me, n, kv[0], kv[1], kv_count, overlap)
                                 : -1;
        be->zero(acc, kv_count * be->act_size);
        blocks(be, a, ctx, i, kv[0], acc);
        if (n == 1)
            return acc; /* no ring: our own keys' gradients */
        if (i > 0) { /* the previous ranks' part of these keys' gradients */
            moe_comm_exchange_finish(comm, hd);
            be->add(acc, r->in, kv_count);
        }
        hd = ring_start(be, comm, me, n, acc, r->in, kv_count, overlap); /* at i = n − 1: home */
        moe_comm_exchange_finish(comm, hk);
        char *t = kv[0];
        kv[0] = kv[1], kv[1] = t;
    }
    moe_comm_exchange_finish(comm, hd);
    return r->in;
}

/* ------------------------------------------------------------ a2a (Ulysses) */

/* Token (s, w, b, c) of the CP group (rank s's chunk w, sequence b, row c) sits at position
 * moe_cp_chunk(cp, s, w)·C + c. "Tokens" layout: this rank's [2][B][C][H][D], every head;
 * "heads" layout: [B][T][H/cp][D], every token of the sequence, this rank's heads. The lse
 * likewise: [2][B][Hq][C] and [B][Hq/cp][T]. Every move below is a strided copy
 * (be->copy_2d) between one of these layouts and a contiguous staging area, and the
 * all-to-all of the staging areas: no element is touched on the host, so GPU ranks run it. */

/* the all-to-all of `per` elements with each of the n ranks of `comm` (a copy with none) */
static void swap_in(const moe_backend *be, moe_comm *comm, int n, const void *send, void *recv,
                    size_t per, moe_dtype t, size_t elem) {
    if (!comm) {
        be->copy(recv, send, per * elem);
        return;
    }
    size_t counts[64] = {0};
    MOE_ASSERT(n <= 64);
    for (int p = 0; p < n; p++)
        counts[p] = per;
    moe_comm_all_to_all_v(comm, send, counts, recv, counts, t);
}

/* A strided piece of a tensor, in elements: `rows` rows of `width` from `off`, `pitch` apart. */
typedef struct piece {
    size_t off, pitch, width, rows;
} piece;

/* rows of a piece between a layout (at `lay`) and a contiguous staging area (at `flat`),
 * `elem` bytes an element: out of the layout (to_flat) or into it */
static void move_piece(const moe_backend *be, char *lay, char *flat, piece s, size_t elem,
                       int to_flat) {
    if (to_flat)
        be->copy_2d(flat, s.width * elem, lay + s.off * elem, s.pitch * elem, s.width * elem,
                    s.rows);
    else
        be->copy_2d(lay + s.off * elem, s.pitch * elem, flat, s.width * elem, s.width * elem,
                    s.rows);
}

/* Ulysses' piece (p, w) of a tensor of H heads (`lse`: of the lse) in the tokens layout
 * (heads = 0: head slice p of this rank's chunk w) or the heads layout (heads = 1: chunk
 * moe_cp_chunk(cp, p, w) of every sequence, this rank's heads). In the staging area of rank
 * p's part it is contiguous, at w·per/2: [w][B][C][H/cp][D] (lse [w][B][Hq/cp][C]). */
static piece a2a_piece(const moe_cp_attention *a, int H, int lse, int p, int w, int heads) {
    const int cp = a->cp, B = a->B, C = a->T / (2 * cp), h = H / cp;
    const size_t row = (size_t)h * a->D, at = (size_t)moe_cp_chunk(cp, p, w) * C;
    piece s;
    if (lse && heads)
        s = (piece){at, (size_t)a->T, (size_t)C, (size_t)B * h};
    else if (lse)
        s = (piece){((size_t)w * B * H + (size_t)p * h) * C, (size_t)H * C, (size_t)h * C, B};
    else if (heads)
        s = (piece){at * row, (size_t)a->T * row, C * row, B};
    else
        s = (piece){(size_t)w * B * C * H * a->D + p * row, (size_t)H * a->D, row, (size_t)B * C};
    return s;
}

/* tokens -> heads (to_heads; src tokens, dst heads) or back (src heads, dst tokens; `add`
 * accumulates, for gradients) of a tensor of H heads (`lse`: the lse, of Hq heads): pack
 * each rank's part, swap, place them. `stage` holds two local-sized tensors: the send and
 * the receive area; an accumulation places into the (then free) send area and adds. */
static void a2a_move(const moe_backend *be, const moe_cp_attention *a, const void *src,
                     void *dst, int H, int lse, int to_heads, int add, char *stage) {
    const int cp = a->cp;
    const size_t elem = lse ? sizeof(moe_real) : be->act_size;
    const size_t per = (size_t)2 * a->B * (a->T / (2 * cp)) * (H / cp) * (lse ? 1 : a->D);
    char *snd = stage, *rcv = stage + per * cp * elem, *out = add ? snd : dst;
    for (int p = 0; p < cp; p++) /* packing reads the start layout */
        for (int w = 0; w < 2; w++)
            move_piece(be, (char *)src, snd + (p * per + w * per / 2) * elem,
                       a2a_piece(a, H, lse, p, w, !to_heads), elem, 1);
    swap_in(be, a->comm, cp, snd, rcv, per, lse ? moe_dtype_real() : moe_dtype_act(be), elem);
    for (int p = 0; p < cp; p++) /* unpacking writes the end layout */
        for (int w = 0; w < 2; w++)
            move_piece(be, out, rcv + (p * per + w * per / 2) * elem,
                       a2a_piece(a, H, lse, p, w, to_heads), elem, 0);
    if (add)
        be->add(dst, snd, per * cp);
}

/* the a2a workspace: my heads' q k v y dy dq dk dv (whole sequence), their lse, staging */
typedef struct a2a_bufs {
    char *q, *k, *v, *y, *dy, *dq, *dk, *dv, *stage;
    moe_real *lse;
} a2a_bufs;

/* Both head-splitting exchanges' workspaces (a2a, a2a+p2p) start with the query side: q, y,
 * dy and dq of nq bytes each from ws on. Returns where the rest begins. */
static char *query_side(void *ws, size_t nq, char **q, char **y, char **dy, char **dq) {
    char *p = ws;
    *q = p, *y = p + nq, *dy = p + 2 * nq, *dq = p + 3 * nq;
    return p + 4 * nq;
}

static a2a_bufs a2a_layout(const moe_backend *be, const moe_cp_attention *a, void *ws) {
    const sizes z = sizes_of(a);
    const size_t S = be->act_size, nq = 2 * z.QC * S, nk = z.KL * S;
    a2a_bufs u;
    char *p = query_side(ws, nq, &u.q, &u.y, &u.dy, &u.dq);
    u.k = p, p += nk;
    u.v = p, p += nk;
    u.dk = p, p += nk;
    u.dv = p, p += nk;
    u.lse = (moe_real *)p, p += 2 * z.LC * sizeof(moe_real);
    u.stage = p; /* 2·nq: a send and a receive area of the largest tensor (or of the lse) */
    return u;
}

static moe_attention_shape a2a_shape(const moe_cp_attention *a) {
    moe_attention_shape s = {a->B, a->T, a->T, a->Hq / a->cp, a->Hkv / a->cp, a->D, 0, 0};
    return s;
}

static void a2a_forward(const moe_backend *be, const moe_cp_attention *a, void *y,
                        moe_real *lse, const void *q, const void *k, const void *v, void *ws) {
    const a2a_bufs u = a2a_layout(be, a, ws);
    a2a_move(be, a, q, u.q, a->Hq, 0, 1, 0, u.stage);
    a2a_move(be, a, k, u.k, a->Hkv, 0, 1, 0, u.stage);
    a2a_move(be, a, v, u.v, a->Hkv, 0, 1, 0, u.stage);
    be->attention_forward(u.y, u.lse, op_ws(be, a, ws, a2a_shape(a)), u.q, u.k, u.v, a2a_shape(a));
    a2a_move(be, a, u.y, y, a->Hq, 0, 0, 0, u.stage);
    a2a_move(be, a, u.lse, lse, a->Hq, 1, 0, 0, u.stage);
}

static void a2a_backward(const moe_backend *be, const moe_cp_attention *a, void *dq, void *dk,
                         void *dv, const void *dy, const void *y, const moe_real *lse,
                         const void *q, const void *k, const void *v, void *ws) {
    const a2a_bufs u = a2a_layout(be, a, ws);
    const sizes z = sizes_of(a);
    a2a_move(be, a, q, u.q, a->Hq, 0, 1, 0, u.stage);
    a2a_move(be, a, k, u.k, a->Hkv, 0, 1, 0, u.stage);
    a2a_move(be, a, v, u.v, a->Hkv, 0, 1, 0, u.stage);
    a2a_move(be, a, y, u.y, a->Hq, 0, 1, 0, u.stage);
    a2a_move(be, a, dy, u.dy, a->Hq, 0, 1, 0, u.stage);
    a2a_move(be, a, lse, u.lse, a->Hq, 1, 1, 0, u.stage);
    be->zero(u.dq, be->act_size * 2 * z.QC);
    be->zero(u.dk, be->act_size * 2 * z.KL);
    be->attention_backward(u.dq, u.dk, u.dv, u.dy, u.y, u.lse, op_ws(be, a, ws, a2a_shape(a)),
                           u.q, u.k, u.v, a2a_shape(a));
    a2a_move(be, a, u.dq, dq, a->Hq, 0, 0, 1, u.stage);
    a2a_move(be, a, u.dk, dk, a->Hkv, 0, 0, 1, u.stage);
    a2a_move(be, a, u.dv, dv, a->Hkv, 0, 0, 1, u.stage);
}


/* ------------------------------------------------------------ a2a+p2p (hierarchical) */

/* After the inner all-to-all a rank holds, for its head slice (H/a2a heads), the rows of
 * every rank of its inner group in "blocks": [src][w][B][C][h][D], block (src, w) being
 * chunk moe_cp_chunk(cp, o·a2a + src, w) of all B sequences (o: this rank's outer rank);
 * lse blocks are [src][w][B][h][C]. Both are one contiguous [B, C, …] operand per block. */

/* head slice p of every local row (of H heads, or of the lse): what inner rank p gets */
static piece inner_piece(const moe_cp_attention *a, int H, int lse, int p) {
    const int n = a->a2a, C = a->T / (2 * a->cp), h = H / n;
    if (lse)
        return (piece){(size_t)p * h * C, (size_t)H * C, (size_t)h * C, (size_t)2 * a->B};
    const size_t row = (size_t)h * a->D;
    return (piece){p * row, (size_t)H * a->D, row, (size_t)2 * a->B * C};
}

/* tokens -> blocks (to_blocks) or back (`add`: accumulate, through `tmp`, a free buffer of
 * the local size) of a tensor of H heads (`lse`: the lse, of Hq heads). What arrives from
 * inner rank s is block s, so the blocks need no unpacking. */
static void inner_move(const moe_backend *be, const moe_cp_attention *a, const void *src,
                       void *dst, int H, int lse, int to_blocks, int add, char *stage,
                       char *tmp) {
    const int n = a->a2a;
    const size_t elem = lse ? sizeof(moe_real) : be->act_size;
    const size_t per = (size_t)2 * a->B * (a->T / (2 * a->cp)) * (H / n) * (lse ? 1 : a->D);
    const moe_dtype t = lse ? moe_dtype_real() : moe_dtype_act(be);
    if (to_blocks) { /* pack slice p for head owner p */
        for (int p = 0; p < n; p++)
            move_piece(be, (char *)src, stage + p * per * elem, inner_piece(a, H, lse, p), elem,
                       1);
        swap_in(be, a->inner, n, stage, dst, per, t, elem);
        return;
    }
    char *out = add ? tmp : dst;
    swap_in(be, a->inner, n, src, stage, per, t, elem);
    for (int p = 0; p < n; p++) /* from head owner p: its slice of this rank's rows */
        move_piece(be, out, stage + p * per * elem, inner_piece(a, H, lse, p), elem, 0);
    if (add)
        be->add(dst, tmp, per * n);
}

typedef struct hyb_bufs {
    char *q, *y, *dy, *dq, *stage, *y_part;
    ring_bufs ring; /* [k | v] and [dk | dv] blocks of the held group */
    moe_real *lse, *lse_part;
    void *ws; /* the whole workspace (op_ws finds the op's part) */
} hyb_bufs;

static hyb_bufs hyb_layout(const moe_backend *be, const moe_cp_attention *a, void *ws) {
    const sizes z = sizes_of(a);
    const size_t S = be->act_size, nq = 2 * z.QC * S, nk = z.KL * S;
    hyb_bufs u;
    char *p = query_side(ws, nq, &u.q, &u.y, &u.dy, &u.dq);
    u.stage = p, p += nq;
    u.ring = ring_layout(p, nk), p += RING_KLS * nk;
    u.lse = (moe_real *)p, p += 2 * z.LC * sizeof(moe_real);
    u.lse_part = (moe_real *)p, p += z.LC / a->a2a * sizeof(moe_real);
    u.y_part = at16(ws, p); /* the attention op stores y 16 bytes at a time */
    u.ws = ws;
    return u;
}

/* one block pair's shape: h query heads, hk key heads, chunks qc and kc */
static moe_attention_shape hyb_shape(const moe_cp_attention *a, int qc, int kc) {
    const int C = a->T / (2 * a->cp);
    moe_attention_shape s = {a->B, C, C, a->Hq / a->a2a, a->Hkv / a->a2a, a->D, qc * C, kc * C};
    return s;
}

/* The blocks of ring step `step` (hybrid): this rank's query blocks against the key blocks
 * of the outer rank held then; every visible pair, forward (merge) or backward (into dq and
 * the held blocks' [dk | dv]). A ring_blocks function; ctx is the hyb_bufs. */
static void hyb_blocks(const moe_backend *be, const moe_cp_attention *a, const void *ctx,
                       int step, const char *kv, char *dkv) {
    const hyb_bufs *u = ctx;
    const int n = a->a2a, p = a->cp / n, o = a->rank / n, o2 = ((o - step) % p + p) % p;
    const sizes z = sizes_of(a);
    const size_t S = be->act_size, QB = z.QC / n, KB = z.KC / n, LB = z.LC / n, nk = z.KL * S;
    for (int sq = 0; sq < n; sq++)
        for (int wq = 0; wq < 2; wq++) {
            const int qc = moe_cp_chunk(a->cp, o * n + sq, wq);
            const size_t qo = (size_t)(sq * 2 + wq) * QB * S, lo = (size_t)(sq * 2 + wq) * LB;
            for (int sk = 0; sk < n; sk++)
                for (int wk = 0; wk < 2; wk++) {
                    const int kc = moe_cp_chunk(a->cp, o2 * n + sk, wk);
                    if (kc > qc)
                        continue;
                    const size_t ko = (size_t)(sk * 2 + wk) * KB * S;
                    const moe_attention_shape sh = hyb_shape(a, qc, kc);
                    if (!dkv) {
                        be->attention_forward(u->y_part, u->lse_part, op_ws(be, a, u->ws, sh),
                                              u->q + qo, kv + ko, kv + nk + ko, sh);
                        be->cp_merge(u->y + qo, u->lse + lo, u->y_part, u->lse_part, a->B,
                                     sh.Tq, sh.Hq, a->D);
                    } else {
                        be->attention_backward(u->dq + qo, dkv + ko, dkv + nk + ko, u->dy + qo,
                                               u->y + qo, u->lse + lo, op_ws(be, a, u->ws, sh),
                                               u->q + qo, kv + ko, kv + nk + ko, sh);
                    }
                }
        }
}

static void hyb_forward(const moe_backend *be, const moe_cp_attention *a, void *y,
                        moe_real *lse, const void *q, const void *k, const void *v, void *ws) {
    hyb_bufs u = hyb_layout(be, a, ws);
    const sizes z = sizes_of(a);
    const size_t S = be->act_size;
    const int n = a->a2a, p = a->cp / n, o = a->rank / n;
    inner_move(be, a, q, u.q, a->Hq, 0, 1, 0, u.stage, NULL);
    inner_move(be, a, k, u.ring.kv[0], a->Hkv, 0, 1, 0, u.stage, NULL);
    inner_move(be, a, v, u.ring.kv[0] + z.KL * S, a->Hkv, 0, 1, 0, u.stage, NULL);
    be->fill_real(u.lse, -INFINITY, 2 * z.LC);
    ring_forward(be, a, a->outer, o, p, &u.ring, hyb_blocks, &u);
    inner_move(be, a, u.y, y, a->Hq, 0, 0, 0, u.stage, NULL);
    inner_move(be, a, u.lse, lse, a->Hq, 1, 0, 0, u.stage, NULL);
}

static void hyb_backward(const moe_backend *be, const moe_cp_attention *a, void *dq, void *dk,
                         void *dv, const void *dy, const void *y, const moe_real *lse,
                         const void *q, const void *k, const void *v, void *ws) {
    hyb_bufs u = hyb_layout(be, a, ws);
    const sizes z = sizes_of(a);
    const size_t S = be->act_size, nk = z.KL * S;
    const int n = a->a2a, p = a->cp / n, o = a->rank / n;
    inner_move(be, a, q, u.q, a->Hq, 0, 1, 0, u.stage, NULL);
    inner_move(be, a, y, u.y, a->Hq, 0, 1, 0, u.stage, NULL);
    inner_move(be, a, dy, u.dy, a->Hq, 0, 1, 0, u.stage, NULL);
    inner_move(be, a, k, u.ring.kv[0], a->Hkv, 0, 1, 0, u.stage, NULL);
    inner_move(be, a, v, u.ring.kv[0] + nk, a->Hkv, 0, 1, 0, u.stage, NULL);
    inner_move(be, a, lse, u.lse, a->Hq, 1, 1, 0, u.stage, NULL);
    be->zero(u.dq, 2 * z.QC * S);
    const char *home = ring_backward(be, a, a->outer, o, p, &u.ring, hyb_blocks, &u);
    /* the accumulations place through buffers free by now: the queries', the outputs' */
    inner_move(be, a, u.dq, dq, a->Hq, 0, 0, 1, u.stage, u.q);
    inner_move(be, a, home, dk, a->Hkv, 0, 0, 1, u.stage, u.y);
    inner_move(be, a, home + nk, dv, a->Hkv, 0, 0, 1, u.stage, u.y);
}

#define AT(p, i) ((char *)(p) + (size_t)(i) * S) /* element i of an activation buffer */

/* What the p2p ring's blocks read and write (the forward's or the backward's tensors). */
typedef struct p2p_ctx {
    void *y;
    moe_real *lse;
    const void *q;
    void *dq;
    const void *dy;
    void *y_part;
    moe_real *lse_part;
    void *ws;
} p2p_ctx;

/* The blocks of ring step `step` (p2p): this rank's query chunks against the chunks of the
 * rank held then that moe_cp_ring_pairs() lists; forward each partial result merges into y
 * by its lse, backward the block gradients add into dq and `dkv`. A ring_blocks function. */
static void p2p_blocks(const moe_backend *be, const moe_cp_attention *a, const void *ctxp,
                       int step, const char *kv, char *dkv) {
    const p2p_ctx *c = ctxp;
    const sizes z = sizes_of(a);
    const size_t S = be->act_size;
    const int s = moe_cp_ring_source(a->cp, a->rank, step);
    moe_cp_pair p[4];
    const int np = moe_cp_ring_pairs(a->cp, a->rank, step, p);
    for (int j = 0; j < np; j++) {
        const int qc = moe_cp_chunk(a->cp, a->rank, p[j].q), kc = moe_cp_chunk(a->cp, s, p[j].k);
        const moe_attention_shape sh = block(a, qc, kc);
        const size_t ko = p[j].k * z.KC;
        const char *kb = AT(kv, ko), *vb = AT(kv, z.KL + ko);
        if (!dkv) {
            be->attention_forward(c->y_part, c->lse_part, op_ws(be, a, c->ws, sh),
                                  AT(c->q, p[j].q * z.QC), kb, vb, sh);
            be->cp_merge(AT(c->y, p[j].q * z.QC), c->lse + p[j].q * z.LC, c->y_part,
                         c->lse_part, a->B, z.C, a->Hq, a->D);
        } else {
            be->attention_backward(AT(c->dq, p[j].q * z.QC), AT(dkv, ko), AT(dkv, z.KL + ko),
                                   AT(c->dy, p[j].q * z.QC), AT(c->y, p[j].q * z.QC),
                                   c->lse + p[j].q * z.LC, op_ws(be, a, c->ws, sh),
                                   AT(c->q, p[j].q * z.QC), kb, vb, sh);
        }
    }
}

void moe_cp_attention_forward(const moe_backend *be, const moe_cp_attention *a, void *y,
                              moe_real *lse, const void *q, const void *k, const void *v,
                              void *ws) {
    const sizes z = sizes_of(a);
    const size_t S = be->act_size;
    char *w = ws;
    const ring_bufs ring = ring_layout(w, z.KL * S);
    /* one partial result: its lse first (no activation count of an odd size misaligns it) */
    moe_real *lse_part = (moe_real *)(w + RING_KLS * z.KL * S);
    void *y_part = at16(ws, lse_part + z.LC); /* the op stores y 16 bytes at a time */
    if (a->type == MOE_CP_A2A) {
        a2a_forward(be, a, y, lse, q, k, v, ws);
        return;
    }
    if (a->type == MOE_CP_A2A_P2P) {
        hyb_forward(be, a, y, lse, q, k, v, ws);
        return;
    }
    be->fill_real(lse, -INFINITY, 2 * z.LC); /* nothing merged yet: every row at lse = −∞ */
    if (a->type == MOE_CP_ALLGATHER) {
        char *all_k = w, *all_v = w + (size_t)a->cp * z.KL * S;
        lse_part = (moe_real *)(all_v + (size_t)a->cp * z.KL * S + 2 * (size_t)a->cp * z.KL * S +
                                z.KL * S);
        y_part = at16(ws, lse_part + z.LC);
        if (a->comm) {
            moe_comm_all_gather(a->comm, k, all_k, z.KL, moe_dtype_act(be));
            moe_comm_all_gather(a->comm, v, all_v, z.KL, moe_dtype_act(be));
        } else {
            be->copy(all_k, k, z.KL * S);
            be->copy(all_v, v, z.KL * S);
        }
        for (int qa = 0; qa < 2; qa++)
            for (int s = 0; s < a->cp; s++)
                for (int kb = 0; kb < 2; kb++) {
                    const int qc = moe_cp_chunk(a->cp, a->rank, qa), kc = moe_cp_chunk(a->cp, s, kb);
                    if (kc > qc) /* every key of a later chunk is masked */
                        continue;
                    const size_t off = (size_t)s * z.KL + kb * z.KC;
                    be->attention_forward(y_part, lse_part, op_ws(be, a, ws, block(a, qc, kc)),
                                          AT(q, qa * z.QC), AT(all_k, off), AT(all_v, off),
                                          block(a, qc, kc));
                    be->cp_merge(AT(y, qa * z.QC), lse + qa * z.LC, y_part, lse_part, a->B,
                                 z.C, a->Hq, a->D);
                }
        return;
    }
    be->copy(ring.kv[0], k, z.KL * S);
    be->copy(AT(ring.kv[0], z.KL), v, z.KL * S);
    const p2p_ctx ctx = {y, lse, q, NULL, NULL, y_part, lse_part, ws};
    ring_forward(be, a, a->comm, a->rank, a->cp, &ring, p2p_blocks, &ctx);
}

void moe_cp_attention_backward(const moe_backend *be, const moe_cp_attention *a, void *dq,
                               void *dk, void *dv, const void *dy, const void *y,
                               const moe_real *lse, const void *q, const void *k, const void *v,
                               void *ws) {
    const sizes z = sizes_of(a);
    const size_t S = be->act_size;
    char *w = ws;
    if (a->type == MOE_CP_A2A) {
        a2a_backward(be, a, dq, dk, dv, dy, y, lse, q, k, v, ws);
        return;
    }
    if (a->type == MOE_CP_A2A_P2P) {
        hyb_backward(be, a, dq, dk, dv, dy, y, lse, q, k, v, ws);
        return;
    }
    if (a->type == MOE_CP_ALLGATHER) {
        /* the forward's gather again (the workspace is shared between calls), then every
         * visible block's gradients into whole-sequence accumulators, reduce-scattered home */
        char *all_k = w, *all_v = w + (size_t)a->cp * z.KL * S;
        char *all_dk = all_v + (size_t)a->cp * z.KL * S, *all_dv = all_dk + (size_t)a->cp * z.KL * S;
        char *mine = all_dv + (size_t)a->cp * z.KL * S;
        if (a->comm) {
            moe_comm_all_gather(a->comm, k, all_k, z.KL, moe_dtype_act(be));
            moe_comm_all_gather(a->comm, v, all_v, z.KL, moe_dtype_act(be));
        } else {
            be->copy(all_k, k, z.KL * S);
            be->copy(all_v, v, z.KL * S);
        }
        be->zero(all_dk, 2 * (size_t)a->cp * z.KL * S);
        for (int qa = 0; qa < 2; qa++)
            for (int s = 0; s < a->cp; s++)
                for (int kb = 0; kb < 2; kb++) {
                    const int qc = moe_cp_chunk(a->cp, a->rank, qa), kc = moe_cp_chunk(a->cp, s, kb);
                    if (kc > qc)
                        continue;
                    const size_t off = (size_t)s * z.KL + kb * z.KC;
                    be->attention_backward(AT(dq, qa * z.QC), AT(all_dk, off), AT(all_dv, off),
                                           AT(dy, qa * z.QC), AT(y, qa * z.QC), lse + qa * z.LC,
                                           op_ws(be, a, ws, block(a, qc, kc)),
                                           AT(q, qa * z.QC), AT(all_k, off), AT(all_v, off),
                                           block(a, qc, kc));
                }
        for (int t = 0; t < 2; t++) { /* each rank's piece of dk, then of dv */
            char *all = t == 0 ? all_dk : all_dv;
            void *out = t == 0 ? dk : dv;
            if (a->comm)
                moe_comm_reduce_scatter_sum(a->comm, all, mine, z.KL, moe_dtype_act(be));
            else
                be->copy(mine, all, z.KL * S);
            be->add(out, mine, z.KL);
        }
        return;
    }
    /* p2p: the ring (ring_backward) */
    const ring_bufs ring = ring_layout(w, z.KL * S);
    be->copy(ring.kv[0], k, z.KL * S);
    be->copy(AT(ring.kv[0], z.KL), v, z.KL * S);
    const p2p_ctx ctx = {(void *)y, (moe_real *)lse, q, dq, dy, NULL, NULL, ws};
    const char *home = ring_backward(be, a, a->comm, a->rank, a->cp, &ring, p2p_blocks, &ctx);
    be->add(dk, home, z.KL);
    be->add(dv, AT(home, z.KL), z.KL);
}
