/*
 * Chapter 02, exercise: the dispatch plan — counts → splits → offsets → sort maps.
 *
 * `make STUDENT=1 check-ch02` links this file in place of the library's
 * moe_dispatch_layout and moe_dispatch_sort_maps (lib/moe/dispatch_layout.c, the
 * reference solution) and runs the chapter's tests on it: the hand-worked plans and
 * invariants of tests/test_dispatch_plan.c, then the expert-parallel training tests of
 * tests/mpi_ep.c on 2 and 4 MPI ranks, whose every exchange follows your plan.
 *
 * The setting. P ranks, E global experts, EL = E / P local experts per rank: rank q owns
 * global experts [q·EL, (q+1)·EL). The counts are already exchanged: every rank knows
 *   all[p·E + e] = rows rank p sends to global expert e.
 * This rank is `rank`; its own counts are mine = all + rank·E. Its rows to send are in
 * its permuted layout, sorted by global expert (expert 0's rows, then expert 1's, ...).
 *
 * moe_dispatch_layout fills (shapes in brackets):
 *   send_rows[P]       rows this rank sends to rank q   = Σ_el mine[q·EL + el]
 *   recv_rows[P]       rows it receives from rank q     = Σ_el all[q·E + rank·EL + el]
 *   expert_offset[EL+1] the EXPERT LAYOUT: local expert el's rows are
 *                      [expert_offset[el], expert_offset[el+1]), and inside that block
 *                      they come from rank 0 first, then rank 1, ... ([el][source])
 *   send_chunks[E]     send_chunks[e] = {offset of expert e's rows in the send layout,
 *                      mine[e], peer = e / EL}
 *   recv_chunks[P·EL]  recv_chunks[q·EL + el] = {where rank q's rows for local expert el
 *                      start in the expert layout, all[q·E + rank·EL + el], peer = q}
 * moe_dispatch_sort_maps fills, from recv_chunks, the maps between the RECEIVED layout
 * ([source][el]: what an all-to-all-v delivers — all of rank 0's rows, then rank 1's, and
 * inside a source by local expert) and the expert layout; R_recv = Σ recv_rows:
 *   sort_map[R_recv]   expert-layout row → received row
 *   unsort_map[R_recv] received row → expert-layout row (the inverse permutation)
 *
 * Worked example (P = 2, E = 4, all = {3,1,0,2 | 1,0,4,2}) on rank 0:
 *   send_rows = {4, 2}, recv_rows = {4, 1}, expert_offset = {0, 4, 5},
 *   recv_chunks = {0,3,0} {4,1,0} {3,1,1} {5,0,1}, unsort_map = sort_map = {0,1,2,4,3}.
 * (tests/test_dispatch_plan.c also works it out for rank 1.)
 *
 * Invariants the tests check on random counts: chunk k that rank p sends to rank q has
 * the count of chunk k that q expects from p; each chunk lies inside its expert's block;
 * the blocks tile [0, R_recv); sort_map and unsort_map are inverses.
 */
#include "../../student.h"
#include "moe/dispatch.h"

void moe_dispatch_layout(const long long *all, int P, int rank, int E, size_t *send_rows,
                         size_t *recv_rows, int *expert_offset, moe_comm_chunk *send_chunks,
                         moe_comm_chunk *recv_chunks) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    /* TODO 1 (splits): send_rows[q] and recv_rows[q] for every rank q. */
    /* TODO 2 (offsets): walk local experts el, and inside each the source ranks q, with a
     *         running row offset: expert_offset[el], and recv_chunks[q·EL + el]. */
    /* TODO 3 (send chunks): a running offset over the global experts e: send_chunks[e]. */
}

void moe_dispatch_sort_maps(int *sort_map, int *unsort_map, const moe_comm_chunk *recv_chunks,
                            int P, int EL) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    /* TODO: walk the chunks in RECEIVED order (q outer, el inner) with a running count of
     *       received rows; row i of chunk (q, el) is received row `received + i` and
     *       expert-layout row `recv_chunks[q·EL + el].offset + i`. */
}
