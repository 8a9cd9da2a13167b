/*
 * The arithmetic of the alltoall dispatcher's plan (chapter 02): counts → splits →
 * offsets → chunk lists → sort maps. Pure host code, no communication: the count
 * exchange has already happened (moe_dispatch_plan_build() all-gathers the counts), so
 * every rank knows all[p][e], the rows rank p sends to global expert e.
 *
 * Experts are placed in blocks: rank q owns global experts [q·EL, (q+1)·EL), EL = E/P.
 * On rank r:
 *   send_rows[q] = Σ_el all[r][q·EL + el]     my rows for q's experts
 *   recv_rows[q] = Σ_el all[q][r·EL + el]     q's rows for my experts
 * The sender's layout is its permuted layout, sorted by global expert, so the chunk for
 * expert e starts where expert e−1's ends. The receiver wants its rows by LOCAL EXPERT
 * first and source rank second ([el][q]: one contiguous block per expert, which is what
 * the experts' GEMMs need), while an all-to-all-v delivers them by source rank first
 * ([q][el]). The receive chunk list places each (q, el) piece straight at its expert-layout
 * offset; the sort maps convert between the two layouts where a plain all-to-all-v (or one
 * rank) is used instead of the chunked exchange.
 */
#include "moe/dispatch.h"

void moe_dispatch_layout(const long long *all, int P, int rank, int E, size_t *send_rows,
                         size_t *recv_rows, int *expert_offset, moe_comm_chunk *send_chunks,
                         moe_comm_chunk *recv_chunks) {
    const int EL = E / P;
    const long long *mine = all + (size_t)rank * E;
    for (int q = 0; q < P; q++) {
        send_rows[q] = recv_rows[q] = 0;
        for (int el = 0; el < EL; el++) {
            send_rows[q] += (size_t)mine[q * EL + el];
            recv_rows[q] += (size_t)all[(size_t)q * E + rank * EL + el];
        }
    }
    /* expert layout [el][q]: local expert el's rows, from rank 0 first */
    size_t off = 0;
    for (int el = 0; el < EL; el++) {
        expert_offset[el] = (int)off;
        for (int q = 0; q < P; q++) {
            const size_t n = (size_t)all[(size_t)q * E + rank * EL + el];
            recv_chunks[q * EL + el] = (moe_comm_chunk){off, n, q};
            off += n;
        }
    }
    expert_offset[EL] = (int)off;
    /* send layout: my permuted rows, by global expert; expert e lives on rank e / EL */
    size_t send_off = 0;
    for (int e = 0; e < E; e++) {
        send_chunks[e] = (moe_comm_chunk){send_off, (size_t)mine[e], e / EL};
        send_off += (size_t)mine[e];
    }
}

void moe_dispatch_sort_maps(int *sort_map, int *unsort_map, const moe_comm_chunk *recv_chunks,
                            int P, int EL) {
    /* walk the pieces in the order an all-to-all-v delivers them: source rank, then expert */
    int received = 0;
    for (int q = 0; q < P; q++)
        for (int el = 0; el < EL; el++) {
            const moe_comm_chunk c = recv_chunks[q * EL + el];
            for (int i = 0; i < (int)c.count; i++) {
                sort_map[(int)c.offset + i] = received + i;
                unsort_map[received + i] = (int)c.offset + i;
            }
            received += (int)c.count;
        }
}
