/*
 * automaton_walk.h: the reference peers' walk of a structured-output automaton,
 * in C for the CUDA peer's replay modes, written once for both sides
 * (DPUF_WALK_FN): CI builds it for the host (walk_host.c) and holds it to the
 * Python walk (dpu_frontend/peer/generator.py: AutomatonWalk;
 * dpu_frontend/ring/automaton.py: distances, shortest_token), token for token.
 *
 * The automaton is read where it lies, as its wire form (docs/protocol.md 5.4):
 * six arrays of 32-bit words after the 64-byte header, checked before anything
 * walks them (decode_automaton's rules; the GPU side's automaton_check): every
 * index below is in bounds only because of those checks.
 *
 * A replayed sequence emits its source's token where the automaton allows it
 * and the end stays within the tokens it may still emit; else the smallest
 * token that leads nearest the end, or the end token where the text may end.
 * Each state's distance to the end (the fewest tokens to a state that may
 * end) comes from sweeps of a relaxation that any number of threads may run
 * over the states at once: the distances only fall, towards the one fixed
 * point, the shortest distances, whatever the order of the updates.
 */
#ifndef DPUF_AUTOMATON_WALK_H
#define DPUF_AUTOMATON_WALK_H

#include <stdint.h>

#ifdef __CUDACC__
#define DPUF_WALK_FN static inline __host__ __device__
#else
#define DPUF_WALK_FN static inline
#endif

/* A distance as the relaxation reads and writes it: on the GPU a volatile word,
 * which threads sweeping other states may lower meanwhile (any value read is
 * one some sweep stored, and each only ever falls). */
#ifdef __CUDA_ARCH__
#define DPUF_WALK_DIST(dist, s) (((volatile int32_t *)(dist))[s])
#else
#define DPUF_WALK_DIST(dist, s) ((dist)[s])
#endif

/* No list entry, no next state, no token. */
#define DPUF_WALK_NONE (-1)
/* A state from which no end is reachable (ring/automaton.py's UNREACHABLE). */
#define DPUF_WALK_UNREACHABLE (1 << 30)

typedef struct dpuf_walk {
    int32_t vocab, eos, states, mask_words;
    const int32_t *list_start;   /* [states + 1] */
    const int32_t *list_tokens;  /* [list_len], each state's run ascending */
    const int32_t *list_next;    /* [list_len] */
    const int32_t *default_next; /* [states] */
    const int32_t *mask_at;      /* [states]: a dense state's bitmask, else NONE */
    const uint32_t *masks;       /* [dense states * mask_words] */
} dpuf_walk;

/* The arrays as they follow the header: `words` its first word past it. */
DPUF_WALK_FN dpuf_walk dpuf_walk_view(const uint32_t *words, int32_t vocab, int32_t eos,
                                      int32_t states, int32_t list_len, int32_t mask_words) {
    dpuf_walk a;
    a.vocab = vocab;
    a.eos = eos;
    a.states = states;
    a.mask_words = mask_words;
    a.list_start = (const int32_t *)words;
    a.list_tokens = a.list_start + states + 1;
    a.list_next = a.list_tokens + list_len;
    a.default_next = a.list_next + list_len;
    a.mask_at = a.default_next + states;
    a.masks = (const uint32_t *)(a.mask_at + states);
    return a;
}

/* The list entry of `token` in `state`, or NONE. */
DPUF_WALK_FN int32_t dpuf_walk_listed(const dpuf_walk *a, int32_t state, int32_t token) {
    int32_t lo = a->list_start[state], hi = a->list_start[state + 1];
    const int32_t end = hi;
    while (lo < hi) {
        const int32_t mid = lo + (hi - lo) / 2;
        if (a->list_tokens[mid] < token)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < end && a->list_tokens[lo] == token ? lo : DPUF_WALK_NONE;
}

/* Whether a dense state's bitmask sets `token`. */
DPUF_WALK_FN int dpuf_walk_masked(const dpuf_walk *a, int32_t state, int32_t token) {
    const int32_t at = a->mask_at[state];
    return at != DPUF_WALK_NONE && token >= 0 && token < a->vocab &&
           ((a->masks[at + token / 32] >> (token % 32)) & 1u);
}

/* Where `token` leads from `state`; NONE where it is not allowed. */
DPUF_WALK_FN int32_t dpuf_walk_next(const dpuf_walk *a, int32_t state, int32_t token) {
    const int32_t i = dpuf_walk_listed(a, state, token);
    if (i != DPUF_WALK_NONE) return a->list_next[i];
    return dpuf_walk_masked(a, state, token) ? a->default_next[state] : DPUF_WALK_NONE;
}

/* One sweep of the distances over share `share` of `shares`, the states
 * [share * S / shares, (share + 1) * S / shares), the last first: a state that
 * may end is at 0, any other one past its nearest successor. Returns whether
 * a distance fell. From UNREACHABLE everywhere, sweeps until none falls leave
 * each state's fewest tokens to an end (distances()'s BFS); on the GPU,
 * threads sweep their shares at once, a barrier between sweeps. Contiguous
 * shares swept downwards: a compiled automaton's states mostly lead to higher
 * ones, so one sweep carries a distance down a whole run of a share's states,
 * and the sweeps needed are about the shares such a run crosses, not its
 * length. */
DPUF_WALK_FN int dpuf_walk_relax(const dpuf_walk *a, int32_t *dist, int32_t share, int32_t shares) {
    int fell = 0;
    const int32_t lo = (int32_t)((int64_t)a->states * share / shares);
    const int32_t hi = (int32_t)((int64_t)a->states * (share + 1) / shares);
    for (int32_t s = hi - 1; s >= lo; s--) {
        int32_t best = DPUF_WALK_UNREACHABLE;
        if (dpuf_walk_next(a, s, a->eos) != DPUF_WALK_NONE) {
            best = 0;
        } else {
            int32_t nearest = DPUF_WALK_UNREACHABLE;
            for (int32_t i = a->list_start[s]; i < a->list_start[s + 1]; i++) {
                const int32_t d = DPUF_WALK_DIST(dist, a->list_next[i]);
                if (d < nearest) nearest = d;
            }
            if (a->mask_at[s] != DPUF_WALK_NONE) {
                const int32_t d = DPUF_WALK_DIST(dist, a->default_next[s]);
                if (d < nearest) nearest = d;
            }
            if (nearest < DPUF_WALK_UNREACHABLE) best = nearest + 1;
        }
        if (best < DPUF_WALK_DIST(dist, s)) {
            DPUF_WALK_DIST(dist, s) = best;
            fell = 1;
        }
    }
    return fell;
}

/* Every state's distance, by one thread (the host build's form). */
DPUF_WALK_FN void dpuf_walk_distances(const dpuf_walk *a, int32_t *dist) {
    for (int32_t s = 0; s < a->states; s++) dist[s] = DPUF_WALK_UNREACHABLE;
    while (dpuf_walk_relax(a, dist, 0, 1)) {
    }
}

/* The smallest token other than the end token that leads from `state` to a
 * successor nearest the end; NONE where every one leads nowhere an end is
 * reachable from (shortest_token). */
DPUF_WALK_FN int32_t dpuf_walk_shortest(const dpuf_walk *a, const int32_t *dist, int32_t state) {
    int32_t best_d = DPUF_WALK_UNREACHABLE, best = DPUF_WALK_NONE;
    for (int32_t i = a->list_start[state]; i < a->list_start[state + 1]; i++) {
        const int32_t token = a->list_tokens[i], d = dist[a->list_next[i]];
        if (token != a->eos && (d < best_d || (d == best_d && best != DPUF_WALK_NONE && token < best))) {
            best_d = d;
            best = token;
        }
    }
    const int32_t at = a->mask_at[state];
    if (at != DPUF_WALK_NONE) {
        /* The bitmask's smallest token that goes to the default: one not listed. */
        for (int32_t w = 0; w < a->mask_words; w++) {
            uint32_t bits = a->masks[at + w];
            while (bits) {
                const uint32_t low = bits & (~bits + 1u);
                int32_t bit = 0;
                while (!((low >> bit) & 1u)) bit++;
                bits ^= low;
                const int32_t token = w * 32 + bit;
                if (token == a->eos || dpuf_walk_listed(a, state, token) != DPUF_WALK_NONE) continue;
                const int32_t d = dist[a->default_next[state]];
                if (d < best_d || (d == best_d && best != DPUF_WALK_NONE && token < best)) {
                    best_d = d;
                    best = token;
                }
                return best_d < DPUF_WALK_UNREACHABLE ? best : DPUF_WALK_NONE;
            }
        }
    }
    return best_d < DPUF_WALK_UNREACHABLE ? best : DPUF_WALK_NONE;
}

/* The token to emit from `*state`, given the source's `candidate` (NONE: it
 * ran out) and `left` tokens the sequence may still emit, this one included;
 * the state moves by it. NONE: no end is reachable from here (AutomatonWalk.choose). */
DPUF_WALK_FN int32_t dpuf_walk_choose(const dpuf_walk *a, const int32_t *dist, int32_t *state,
                                      int32_t candidate, int64_t left) {
    if (candidate != DPUF_WALK_NONE) {
        const int32_t next = dpuf_walk_next(a, *state, candidate);
        if (next != DPUF_WALK_NONE && (candidate == a->eos || (int64_t)dist[next] <= left - 1)) {
            *state = next;
            return candidate;
        }
    }
    if (dist[*state] == 0) return a->eos;
    const int32_t token = dpuf_walk_shortest(a, dist, *state);
    if (token != DPUF_WALK_NONE) *state = dpuf_walk_next(a, *state, token);
    return token;
}

#endif /* DPUF_AUTOMATON_WALK_H */
