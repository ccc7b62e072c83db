/*
 * walk_host.c: automaton_walk.h built for the host, for the tests that hold it
 * to the Python walk (dpu_frontend/gpu/automaton_walk.py loads it). The CUDA
 * peer runs the same functions on the GPU.
 */
#include "automaton_walk.h"

#define EXPORT __attribute__((visibility("default")))

/* Every state's distance to the end, by one thread. */
EXPORT void dpuf_walk_host_distances(const uint32_t *words, int32_t vocab, int32_t eos,
                                     int32_t states, int32_t list_len, int32_t mask_words,
                                     int32_t *dist) {
    const dpuf_walk a = dpuf_walk_view(words, vocab, eos, states, list_len, mask_words);
    dpuf_walk_distances(&a, dist);
}

/* One sweep over share `share` of `shares` of the states: whether a distance fell. */
EXPORT int dpuf_walk_host_relax(const uint32_t *words, int32_t vocab, int32_t eos,
                                int32_t states, int32_t list_len, int32_t mask_words,
                                int32_t *dist, int32_t share, int32_t shares) {
    const dpuf_walk a = dpuf_walk_view(words, vocab, eos, states, list_len, mask_words);
    return dpuf_walk_relax(&a, dist, share, shares);
}

/* The token a replayed sequence emits from *state (the state moved by it). */
EXPORT int32_t dpuf_walk_host_choose(const uint32_t *words, int32_t vocab, int32_t eos,
                                     int32_t states, int32_t list_len, int32_t mask_words,
                                     const int32_t *dist, int32_t *state, int32_t candidate,
                                     int64_t left) {
    const dpuf_walk a = dpuf_walk_view(words, vocab, eos, states, list_len, mask_words);
    return dpuf_walk_choose(&a, dist, state, candidate, left);
}
