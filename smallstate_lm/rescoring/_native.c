/* The loops of lattice rescoring that stay sequential whatever is batched: the lazy k-best search over
 * one expanded lattice (kbest.py, `_LazyKbest`), and the walk over the state records of a binary vector
 * FST, reading (fst_binary.py, `_read_vector`) and writing (`write_fst_bytes`). Each function here does
 * exactly what its Python twin does, so the results are the same bit for bit (tests/test_native.py); the
 * Python code stays the reference and the fallback where this library was not built (scripts/setup.sh
 * builds it; plain C99, no Python headers: it is loaded with ctypes).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef SSL_SOURCE_SHA1
#define SSL_SOURCE_SHA1 "unknown"
#endif

/* The SHA-1 of the source this library was built from (scripts/build_native.sh): native.py uses no other. */
const char *ssl_source(void) { return SSL_SOURCE_SHA1; }

/* ---- growable arrays ---------------------------------------------------------------------------- */

typedef struct { double c; int64_t e, j, prefix; } Deriv;
typedef struct { double c; int64_t e, j; } Cand;
typedef struct { int64_t v, k; } Frame;

#define GROW(ptr, len, cap, type)                                                        \
    do {                                                                                 \
        if ((len) == (cap)) {                                                            \
            int64_t new_cap_ = (cap) ? 2 * (cap) : 4;                                    \
            type *p_ = (type *)realloc((ptr), (size_t)new_cap_ * sizeof(type));         \
            if (!p_) return -1;                                                          \
            (ptr) = p_;                                                                  \
            (cap) = new_cap_;                                                            \
        }                                                                                \
    } while (0)

/* ---- a hash map from 64-bit keys to 64-bit values (open addressing) --------------------------- */

typedef struct { uint64_t *keys; int64_t *vals; uint8_t *used; int64_t size, cap; } Map;

static uint64_t mix(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}

static int map_init(Map *m, int64_t cap) {
    m->cap = 16;
    while (m->cap < 2 * cap) m->cap *= 2;
    m->size = 0;
    m->keys = (uint64_t *)calloc((size_t)m->cap, sizeof(uint64_t));
    m->vals = (int64_t *)calloc((size_t)m->cap, sizeof(int64_t));
    m->used = (uint8_t *)calloc((size_t)m->cap, 1);
    if (m->keys && m->vals && m->used) return 0;
    free(m->keys); free(m->vals); free(m->used);
    m->keys = NULL; m->vals = NULL; m->used = NULL;
    return -1;
}

static void map_free(Map *m) { free(m->keys); free(m->vals); free(m->used); }

static int64_t *map_slot(Map *m, uint64_t key, int *found) {
    uint64_t i = mix(key) & (uint64_t)(m->cap - 1);
    while (m->used[i]) {
        if (m->keys[i] == key) { *found = 1; return &m->vals[i]; }
        i = (i + 1) & (uint64_t)(m->cap - 1);
    }
    *found = 0;
    return NULL;
}

static int map_put(Map *m, uint64_t key, int64_t val) {
    if (2 * (m->size + 1) > m->cap) {
        Map bigger;
        if (map_init(&bigger, m->cap) != 0) return -1;
        for (int64_t i = 0; i < m->cap; i++)
            if (m->used[i]) map_put(&bigger, m->keys[i], m->vals[i]);
        map_free(m);
        *m = bigger;
    }
    uint64_t i = mix(key) & (uint64_t)(m->cap - 1);
    while (m->used[i]) {
        if (m->keys[i] == key) { m->vals[i] = val; return 0; }
        i = (i + 1) & (uint64_t)(m->cap - 1);
    }
    m->used[i] = 1; m->keys[i] = key; m->vals[i] = val; m->size++;
    return 0;
}

/* ---- heap of candidates, ordered as Python orders the tuples (cost, arc, rank) ------------------ */

static int less(const Cand *a, const Cand *b) {
    if (a->c != b->c) return a->c < b->c;
    if (a->e != b->e) return a->e < b->e;
    return a->j < b->j;
}

static void sift_up(Cand *h, int64_t i) {
    Cand x = h[i];
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!less(&x, &h[p])) break;
        h[i] = h[p]; i = p;
    }
    h[i] = x;
}

static void sift_down(Cand *h, int64_t n, int64_t i) {
    Cand x = h[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && less(&h[c + 1], &h[c])) c++;
        if (!less(&h[c], &x)) break;
        h[i] = h[c]; i = c;
    }
    h[i] = x;
}

/* ---- lazy k-best ---------------------------------------------------------------------------------- */

typedef struct {
    Deriv *d; int64_t nd, capd;   /* derivations, best first, distinct prefixes */
    Cand *h; int64_t nh, caph;    /* candidates */
    int64_t pend_e, pend_j;       /* last pop whose successor is not pushed yet (pend_e < 0: none) */
    int8_t has_heap, exhausted;
} Node;

typedef struct {
    int64_t n_nodes;
    const int64_t *src, *word, *in_start, *in_arcs;
    const double *cost;
    double *arc_best;
    Node *nodes;
    Map trie, seen;   /* (prefix, word) -> prefix id; (node, prefix) -> 1 */
    Frame *stack; int64_t ns, caps;
    int64_t pops;
} Kbest;

static int first_candidates(Kbest *kb, Node *nd, int64_t v) {
    for (int64_t a = kb->in_start[v]; a < kb->in_start[v + 1]; a++) {
        int64_t e = kb->in_arcs[a];
        if (kb->arc_best[e] < INFINITY) {
            GROW(nd->h, nd->nh, nd->caph, Cand);
            nd->h[nd->nh].c = kb->arc_best[e]; nd->h[nd->nh].e = e; nd->h[nd->nh].j = 0;
            nd->nh++;
        }
    }
    for (int64_t i = nd->nh / 2 - 1; i >= 0; i--) sift_down(nd->h, nd->nh, i);
    nd->has_heap = 1;
    return 0;
}

static int push(Kbest *kb, int64_t v, int64_t k) {
    GROW(kb->stack, kb->ns, kb->caps, Frame);
    kb->stack[kb->ns].v = v; kb->stack[kb->ns].k = k; kb->ns++;
    return 0;
}

/* _LazyKbest.ensure: 1 done, 0 stopped by the pop cap, -1 out of memory */
static int ensure(Kbest *kb, int64_t v0, int64_t k0, int64_t max_pops) {
    kb->ns = 0;
    if (push(kb, v0, k0) != 0) return -1;
    while (kb->ns) {
        int64_t v = kb->stack[kb->ns - 1].v, k = kb->stack[kb->ns - 1].k;
        Node *nd = &kb->nodes[v];
        if (nd->nd > k || nd->exhausted) { kb->ns--; continue; }
        if (!nd->has_heap && first_candidates(kb, nd, v) != 0) return -1;
        if (nd->pend_e >= 0) {
            int64_t e = nd->pend_e, j = nd->pend_j;
            Node *u = &kb->nodes[kb->src[e]];
            if (u->nd <= j + 1 && !u->exhausted) {
                if (push(kb, kb->src[e], j + 1) != 0) return -1;
                continue;
            }
            nd->pend_e = -1;
            if (u->nd > j + 1) {
                GROW(nd->h, nd->nh, nd->caph, Cand);
                nd->h[nd->nh].c = u->d[j + 1].c + kb->cost[e]; nd->h[nd->nh].e = e; nd->h[nd->nh].j = j + 1;
                sift_up(nd->h, nd->nh++);
            }
        }
        if (nd->nh == 0) { nd->exhausted = 1; kb->ns--; continue; }
        Cand top = nd->h[0];
        Node *u = &kb->nodes[kb->src[top.e]];
        if (u->nd <= top.j) {
            if (push(kb, kb->src[top.e], top.j) != 0) return -1;
            continue;
        }
        if (kb->pops >= max_pops) return 0;
        kb->pops++;
        nd->h[0] = nd->h[--nd->nh];
        if (nd->nh) sift_down(nd->h, nd->nh, 0);
        int64_t prefix = u->d[top.j].prefix;
        if (kb->word[top.e] >= 0) {
            uint64_t key = ((uint64_t)prefix << 32) ^ (uint64_t)(uint32_t)kb->word[top.e];
            int found;
            int64_t *id = map_slot(&kb->trie, key, &found);
            if (found) prefix = *id;
            else {
                int64_t fresh = kb->trie.size + 1;
                if (map_put(&kb->trie, key, fresh) != 0) return -1;
                prefix = fresh;
            }
        }
        uint64_t seen_key = ((uint64_t)v << 32) ^ (uint64_t)prefix;
        int found;
        map_slot(&kb->seen, seen_key, &found);
        if (!found) {
            if (map_put(&kb->seen, seen_key, 1) != 0) return -1;
            GROW(nd->d, nd->nd, nd->capd, Deriv);
            nd->d[nd->nd].c = top.c; nd->d[nd->nd].e = top.e; nd->d[nd->nd].j = top.j;
            nd->d[nd->nd].prefix = prefix;
            nd->nd++;
        }
        nd->pend_e = top.e; nd->pend_j = top.j;
    }
    return 1;
}

/* kbest_paths on a DAG whose node n_nodes - 1 is the sink and whose arcs n_arcs - n_finals.. are the
 * finals: fills, for each of the (at most n) sequences found, its total, its last arc, the number of
 * its arcs, and the arcs of all of them one path after the other in out_arcs (room for `room`).
 * Returns how many were found; -1 when out of memory; -2 when out_arcs is too small, with the room
 * needed in *out_pops (call again with that much). *truncated says whether the pop cap stopped the
 * search. Node and word ids and max_pops (which bounds the prefix ids) must be below 2**31: the caller
 * checks. */
int64_t ssl_kbest(int64_t n_nodes, const int64_t *src, const double *cost, const int64_t *word,
                  const int64_t *in_start, const int64_t *in_arcs, int64_t n_arcs, int64_t n, int64_t max_pops,
                  double *out_total, int64_t *out_last, int64_t *out_len, int64_t *out_arcs, int64_t room,
                  int64_t *out_pops, int64_t *truncated) {
    Kbest kb;
    memset(&kb, 0, sizeof kb);
    kb.n_nodes = n_nodes; kb.src = src; kb.cost = cost; kb.word = word;
    kb.in_start = in_start; kb.in_arcs = in_arcs;
    int64_t found = -1, sink = n_nodes - 1;
    double *alpha = (double *)malloc((size_t)n_nodes * sizeof(double));
    kb.arc_best = (double *)malloc((size_t)(n_arcs ? n_arcs : 1) * sizeof(double));
    kb.nodes = (Node *)calloc((size_t)n_nodes, sizeof(Node));
    if (!alpha || !kb.arc_best || !kb.nodes || map_init(&kb.trie, 64) || map_init(&kb.seen, 64)) goto done;
    alpha[0] = 0.0;
    for (int64_t v = 1; v < n_nodes; v++) {  /* _forward: in-arcs in arc order, strictly better wins */
        double best = INFINITY;
        for (int64_t a = in_start[v]; a < in_start[v + 1]; a++) {
            int64_t e = in_arcs[a];
            double d = alpha[src[e]] + cost[e];
            if (d < best) best = d;
        }
        alpha[v] = best;
    }
    for (int64_t e = 0; e < n_arcs; e++) kb.arc_best[e] = alpha[src[e]] + cost[e];
    for (int64_t v = 0; v < n_nodes; v++) kb.nodes[v].pend_e = -1;
    {
        Node *start = &kb.nodes[0];  /* the empty path is the start's only derivation */
        start->d = (Deriv *)malloc(sizeof(Deriv));
        if (!start->d) goto done;
        start->d[0].c = 0.0; start->d[0].e = -1; start->d[0].j = -1; start->d[0].prefix = 0;
        start->nd = start->capd = 1;
        start->exhausted = 1;
    }
    *truncated = 0;
    for (int64_t k = 0; k < n; k++) {
        int r = ensure(&kb, sink, k, max_pops);
        if (r < 0) goto done;
        if (r == 0) { *truncated = 1; break; }
        if (kb.nodes[sink].nd <= k) break;
    }
    found = kb.nodes[sink].nd < n ? kb.nodes[sink].nd : n;
    int64_t total_len = 0;
    for (int64_t r = 0; r < found; r++) {  /* arcs_of: the lengths first, to check the room */
        int64_t len = 0, v = sink, k = r;
        while (v != 0) { Deriv *d = &kb.nodes[v].d[k]; len++; k = d->j; v = src[d->e]; }
        out_len[r] = len;
        total_len += len;
    }
    if (total_len > room) { *out_pops = total_len; found = -2; goto done; }
    for (int64_t r = 0, at = 0; r < found; at += out_len[r], r++) {  /* each path written from its end */
        int64_t *row = out_arcs + at, i = out_len[r], v = sink, k = r;
        while (v != 0) { Deriv *d = &kb.nodes[v].d[k]; row[--i] = d->e; k = d->j; v = src[d->e]; }
        out_total[r] = kb.nodes[sink].d[r].c;
        out_last[r] = kb.nodes[sink].d[r].e;
    }
    *out_pops = kb.pops;
done:
    if (kb.nodes)
        for (int64_t v = 0; v < n_nodes; v++) { free(kb.nodes[v].d); free(kb.nodes[v].h); }
    free(kb.nodes); free(alpha); free(kb.arc_best); free(kb.stack);
    map_free(&kb.trie); map_free(&kb.seen);
    return found;
}

/* ---- vector FST state records ------------------------------------------------------------------- */

/* The state records of a vector FST after its header (write_fst_bytes): for each of the S states its
 * final weight (k float32), its arc count (int64) and its arcs (records of 4k + 12 bytes, all states'
 * arcs in state order in `arcs`), written one after the other into `out`. */
void ssl_vector_write(int64_t S, int64_t k, const float *final, const int64_t *narcs, const uint8_t *arcs,
                      uint8_t *out) {
    int64_t arc_size = 4 * k + 12;
    for (int64_t s = 0; s < S; s++) {
        memcpy(out, final + s * k, (size_t)(4 * k)); out += 4 * k;
        memcpy(out, narcs + s, 8); out += 8;
        size_t bytes = (size_t)(narcs[s] * arc_size);
        memcpy(out, arcs, bytes); out += bytes; arcs += bytes;
    }
}

/* ---- searches over graphs numbered in topological order (every arc goes up), arcs sorted by source ---- */

/* state_levels: longest-path depth of each state. An arc's source has its depth once every arc into it
 * is done, and those all come earlier in source order. */
void ssl_levels_up(int64_t S, int64_t A, const int64_t *src, const int64_t *dst, int64_t *level) {
    memset(level, 0, (size_t)S * sizeof(int64_t));
    for (int64_t e = 0; e < A; e++)
        if (level[src[e]] + 1 > level[dst[e]]) level[dst[e]] = level[src[e]] + 1;
}

/* viterbi: best cost from the nodes in `sources` (dist 0) to every node, and its best in-arc (the
 * lowest arc index among the cheapest; -1 without in-arcs), as the level-at-a-time version gives. */
void ssl_viterbi_up(int64_t S, int64_t A, const int64_t *src, const int64_t *dst, const double *cost,
                    int64_t n_sources, const int64_t *sources, double *dist, int64_t *back) {
    for (int64_t v = 0; v < S; v++) { dist[v] = INFINITY; back[v] = -1; }
    for (int64_t i = 0; i < n_sources; i++) dist[sources[i]] = 0.0;
    for (int64_t e = 0; e < A; e++) {
        int64_t d = dst[e];
        double cand = dist[src[e]] + cost[e];
        if (cand < dist[d] || (cand == dist[d] && (back[d] < 0 || e < back[d]))) { dist[d] = cand; back[d] = e; }
    }
}

/* _backward: best completion cost from each state (`beta` holds the final costs on entry), from the last
 * state back: an arc's target is complete once every arc out of it (later in source order) is done. */
void ssl_backward_up(int64_t A, const int64_t *src, const int64_t *dst, const double *cost, double *beta) {
    for (int64_t e = A - 1; e >= 0; e--) {
        double c = cost[e] + beta[dst[e]];
        if (c < beta[src[e]]) beta[src[e]] = c;
    }
}

/* The records of a well-formed vector FST from byte pos: each state's arc count, final weight (4k bytes,
 * to `finals`) and arcs (to `arcs`, one after the other: the file less the record heads). Stops at the
 * first record that is not whole (a negative count, arcs past the end), leaving *end past n: the caller
 * then reads the file the slow way, for its error. Returns the number of whole records. */
int64_t ssl_vector_read(const uint8_t *data, int64_t n, int64_t pos, int64_t todo, int64_t k, int64_t cap,
                        int64_t *counts, uint8_t *finals, uint8_t *arcs, int64_t *end) {
    int64_t head = 4 * k + 8, arc_size = 4 * k + 12, last = n - head, s = 0;
    while (s < todo && s < cap && pos <= last) {
        int64_t narcs;
        memcpy(&narcs, data + pos + 4 * k, 8);
        if (narcs < 0 || narcs > (n - pos - head) / arc_size) { pos = n + 1; break; }
        counts[s] = narcs;
        memcpy(finals + s * 4 * k, data + pos, (size_t)(4 * k));
        memcpy(arcs, data + pos + head, (size_t)(narcs * arc_size));
        arcs += narcs * arc_size;
        pos += head + narcs * arc_size;
        s++;
    }
    *end = pos;
    return s;
}

/* ---- merging paths by (lattice state, history key) ------------------------------------------------ */

/* For rows i = 0..n-1: group[i] = the number of the distinct (a[i], b[i]) pair, numbered in order of first
 * appearance; winner[g] = the row of group g with the lowest cost (the first of equal costs), first[g] =
 * its first row. Returns the number of groups, -1 when out of memory. */
int64_t ssl_group_min(int64_t n, const int64_t *a, const int64_t *b, const double *cost, int64_t *group,
                      int64_t *winner, int64_t *first) {
    int64_t cap = 16, G = 0;
    while (cap < 2 * n) cap *= 2;
    int64_t *slot = (int64_t *)malloc((size_t)cap * sizeof(int64_t));  /* group number + 1, 0: empty */
    if (!slot) return -1;
    memset(slot, 0, (size_t)cap * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) {
        uint64_t h = mix((uint64_t)a[i] * 0x9e3779b97f4a7c15ULL ^ mix((uint64_t)b[i])) & (uint64_t)(cap - 1);
        int64_t g;
        for (;;) {
            if (slot[h] == 0) {
                g = G++;
                slot[h] = g + 1;
                winner[g] = first[g] = i;
                break;
            }
            g = slot[h] - 1;
            if (a[first[g]] == a[i] && b[first[g]] == b[i]) {
                if (cost[i] < cost[winner[g]]) winner[g] = i;
                break;
            }
            h = (h + 1) & (uint64_t)(cap - 1);
        }
        group[i] = g;
    }
    free(slot);
    return G;
}
