/*
 * automaton_pool.cuh: structured output's automata in GPU memory (protocol 5.4),
 * for the two kernels that take them out of a request's arena span: the
 * scheduler inside the GPU (model/device/scheduler.cu, whose sampler masks the
 * logits by them) and the CUDA peer (peer_kernel.cu, whose replay walks them
 * with automaton_walk.h, each state's distance to the end beside its arrays).
 *
 * One copy per constraint (its key and size: "one key, one automaton"), counted
 * by the sequences walking it, kept unused until its room is needed, the least
 * recently taken going first. Thread-0 functions run on the one thread of the
 * one block that takes requests in; the check runs on every thread of that
 * block. The pool's words are checked (automaton_faulty) before anything walks
 * them: every index a walk follows is in bounds only because of that check.
 */
#ifndef DPUF_AUTOMATON_POOL_CUH
#define DPUF_AUTOMATON_POOL_CUH

#include "ring_device.cuh"

/* The 64-byte header's 32-bit words (dpuf_automaton). */
#define AUT_VOCAB 3
#define AUT_EOS 4
#define AUT_STATES 5
#define AUT_LIST 6
#define AUT_MASK_WORDS 7
#define AUT_DENSE 8
#define AUT_TOTAL 9
#define AUT_KEY 10
static_assert(offsetof(dpuf_automaton, vocab_size) == 4 * AUT_VOCAB && offsetof(dpuf_automaton, eos) == 4 * AUT_EOS &&
                  offsetof(dpuf_automaton, states) == 4 * AUT_STATES &&
                  offsetof(dpuf_automaton, list_len) == 4 * AUT_LIST &&
                  offsetof(dpuf_automaton, mask_words) == 4 * AUT_MASK_WORDS &&
                  offsetof(dpuf_automaton, dense_states) == 4 * AUT_DENSE &&
                  offsetof(dpuf_automaton, total_bytes) == 4 * AUT_TOTAL && offsetof(dpuf_automaton, key) == 4 * AUT_KEY,
              "the automaton header's words");

/* An automaton in the pool: its arrays from word `base`, then (with
 * `distances`) each state's distance to the end. */
struct automaton_slot {
    uint64_t key;
    uint64_t base, words; /* its place in the pool, whole 128-byte lines */
    uint64_t used_at;     /* the taker's clock when last taken: the least recent goes first */
    uint32_t bytes;       /* its total_bytes */
    uint32_t users;
    uint32_t live;
    uint32_t states, list_len, dense, eos;
};

/* A pool and its table of slots. */
struct automaton_pool {
    automaton_slot *slots; /* [n_slots] */
    uint32_t n_slots;
    uint32_t vocab;        /* the tokenizer's: every automaton is over it */
    int32_t *words;        /* [pool_words], NULL: no structured output */
    uint64_t pool_words;
    bool distances;        /* each slot keeps its states' distances after its arrays */
};

/* Where request wd's automaton lies in channel d's arena (read_request checked
 * the span). */
__device__ __forceinline__ const uint8_t *automaton_at(const uint8_t *region, const dpuf_channel_desc *d,
                                                       const uint32_t *wd) {
    return region + d->arena_offset + req_u64(wd, REQ_ARENA) + automaton_offset(wd[REQ_PROMPT_LEN]);
}

/* A size an automaton can have: a header and whole 32-bit words. */
__device__ __forceinline__ bool automaton_sized(uint32_t bytes) {
    return bytes >= DPUF_AUTOMATON_HEADER_SIZE && bytes % 4u == 0;
}

/* The pool words an automaton of `bytes` takes: its arrays, whole 128-byte lines. */
__device__ __forceinline__ uint64_t automaton_words(uint32_t bytes) {
    return ((uint64_t)(bytes - DPUF_AUTOMATON_HEADER_SIZE) / 4u + 31u) / 32u * 32u;
}

/* The pool words its slot takes: the arrays, then with `distances` one word a
 * state (the header checked: automaton_header_ok). */
__device__ __forceinline__ uint64_t automaton_slot_words(const automaton_pool &p, uint32_t bytes,
                                                        uint32_t states) {
    return automaton_words(bytes) + (p.distances ? ((uint64_t)states + 31u) / 32u * 32u : 0u);
}

/* One thread: the 64-byte header, fresh (the arena span is rewritten for later
 * requests). */
__device__ void automaton_header(const uint8_t *at, uint32_t *h) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint4 v = __ldcv((const uint4 *)at + i);
        h[4 * i] = v.x;
        h[4 * i + 1] = v.y;
        h[4 * i + 2] = v.z;
        h[4 * i + 3] = v.w;
    }
}

__device__ __forceinline__ uint64_t automaton_key(const uint32_t *h) {
    return h[AUT_KEY] | (uint64_t)h[AUT_KEY + 1] << 32;
}

/* Does header h describe an automaton of `bytes` over the pool's vocabulary
 * (decode_automaton's header rules)? */
__device__ bool automaton_header_ok(const automaton_pool &p, const uint32_t *h, uint32_t bytes) {
    const uint32_t mask_words = (p.vocab + 31u) / 32u;
    const uint64_t S = h[AUT_STATES], L = h[AUT_LIST], D = h[AUT_DENSE];
    const uint64_t need = DPUF_AUTOMATON_HEADER_SIZE + 4u * ((S + 1) + 2 * L + 2 * S + D * mask_words);
    /* "DPUFAUT1", little-endian */
    return h[0] == 0x46555044u && h[1] == 0x31545541u && h[2] == DPUF_AUTOMATON_HEADER_SIZE &&
           h[AUT_VOCAB] == p.vocab && h[AUT_MASK_WORDS] == mask_words && h[AUT_EOS] < p.vocab && S >= 1 && D <= S &&
           h[AUT_TOTAL] == bytes && need == bytes;
}

/* Thread 0: the slot holding the automaton (key, bytes), -1: none. */
__device__ int32_t automata_find(const automaton_pool &p, uint64_t key, uint32_t bytes) {
    for (uint32_t k = 0; k < p.n_slots; k++) {
        const automaton_slot &t = p.slots[k];
        if (t.live && t.key == key && t.bytes == bytes) return (int32_t)k;
    }
    return -1;
}

/* Does slot t hold room (for automata_fit)? Live, and with `in_use` only if a
 * sequence walks it (unused copies counted as evictable). */
__device__ __forceinline__ bool automaton_holds(const automaton_slot &t, bool in_use) {
    return t.live && (!in_use || t.users > 0);
}

/* Thread 0: the lowest start of a free run of `words` pool words, UINT64_MAX:
 * none (the candidates: the pool's start and the end of each copy). `in_use`:
 * as if every unused copy were gone. */
__device__ uint64_t automata_fit(const automaton_pool &p, uint64_t words, bool in_use = false) {
    uint64_t best = UINT64_MAX;
    if (words > p.pool_words) return best;
    for (int32_t c = -1; c < (int32_t)p.n_slots; c++) {
        if (c >= 0 && !automaton_holds(p.slots[c], in_use)) continue;
        const uint64_t start = c < 0 ? 0 : p.slots[c].base + p.slots[c].words;
        if (start >= best || start > p.pool_words - words) continue;
        bool clear = true;
        for (uint32_t k = 0; k < p.n_slots && clear; k++) {
            const automaton_slot &t = p.slots[k];
            clear = !automaton_holds(t, in_use) || t.base >= start + words || start >= t.base + t.words;
        }
        if (clear) best = start;
    }
    return best;
}

/* Thread 0: a free slot of the table, -1: none. */
__device__ int32_t automata_free_slot(const automaton_pool &p) {
    for (uint32_t k = 0; k < p.n_slots; k++)
        if (!p.slots[k].live) return (int32_t)k;
    return -1;
}

/* Thread 0: is there room for the automaton (key, bytes) in a slot of `words`?
 * The pool holds it, or a slot and a run of words are free once unused copies
 * are evicted (the least recently taken first; each eviction counted in
 * *evicted). False: the request waits. */
__device__ bool automata_room(const automaton_pool &p, uint64_t key, uint32_t bytes, uint64_t words,
                              uint64_t *evicted) {
    if (automata_find(p, key, bytes) >= 0) return true;
    /* Evict nothing where evicting every unused copy would not make room: those
     * copies stay for the requests that bring them again. */
    bool slot = false;
    for (uint32_t k = 0; k < p.n_slots && !slot; k++) slot = !automaton_holds(p.slots[k], true);
    if (!slot || automata_fit(p, words, true) == UINT64_MAX) return false;
    for (;;) {
        if (automata_free_slot(p) >= 0 && automata_fit(p, words) != UINT64_MAX) return true;
        int32_t victim = -1;
        for (uint32_t k = 0; k < p.n_slots; k++) {
            const automaton_slot &t = p.slots[k];
            if (t.live && t.users == 0 && (victim < 0 || t.used_at < p.slots[victim].used_at)) victim = (int32_t)k;
        }
        if (victim < 0) return false;
        p.slots[victim].live = 0;
        (*evicted)++;
    }
}

/* What automata_take found. */
struct automaton_taken {
    int32_t slot;   /* -1: none (bad) */
    uint32_t fresh; /* the pool did not hold it: to copy and check */
    uint32_t bad;   /* its size or header fails a check */
};

/* Thread 0: the automaton at `at` (`bytes`, its room judged by automata_room):
 * the pool's copy, one more user, or, for an automaton the pool does not hold,
 * its header checked and a place made. `clock` orders the evictions. */
__device__ automaton_taken automata_take(const automaton_pool &p, const uint8_t *at, uint32_t bytes,
                                         uint64_t clock) {
    automaton_taken out = {-1, 0, 0};
    if (!automaton_sized(bytes)) { /* not even a header: nothing to read */
        out.bad = 1;
        return out;
    }
    uint32_t h[16];
    automaton_header(at, h);
    const uint64_t key = automaton_key(h);
    int32_t k = automata_find(p, key, bytes);
    if (k < 0) {
        if (!automaton_header_ok(p, h, bytes)) {
            out.bad = 1;
            return out;
        }
        const uint64_t words = automaton_slot_words(p, bytes, h[AUT_STATES]);
        k = automata_free_slot(p);
        const uint64_t base = k >= 0 ? automata_fit(p, words) : UINT64_MAX;
        if (base == UINT64_MAX) { /* judged, so never: refused rather than trusted */
            out.bad = 1;
            return out;
        }
        automaton_slot &t = p.slots[k];
        t.key = key;
        t.bytes = bytes;
        t.base = base;
        t.words = words;
        t.users = 0;
        t.live = 1;
        t.states = h[AUT_STATES];
        t.list_len = h[AUT_LIST];
        t.dense = h[AUT_DENSE];
        t.eos = h[AUT_EOS];
        out.fresh = 1;
    }
    p.slots[k].users++;
    p.slots[k].used_at = clock;
    out.slot = k;
    return out;
}

/* Is `i` where some state's list starts (list_start[s] == i)? A binary search:
 * a list_start that is not ascending fails its own check anyway. */
__device__ bool list_starts_at(const int32_t *list_start, int64_t states, int64_t i) {
    int64_t lo = 0, hi = states;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (list_start[mid] < i) lo = mid + 1;
        else hi = mid;
    }
    return lo <= states && list_start[lo] == i;
}

/* All threads: does the copy in slot t fail a check of decode_automaton's
 * (ring/automaton.py)? Each index within its array, each list ascending ids
 * below the vocabulary, each dense state with a default and a whole bitmask
 * of its own offset, D of them, no bit past the vocabulary, every state
 * allowing a token. (Not checked: two dense states sharing one bitmask; the
 * walk is the same either way.) `dense`: a shared word, zeroed before the
 * barrier that precedes the call. */
__device__ bool automaton_faulty(const automaton_pool &p, const automaton_slot &t, uint32_t *dense) {
    const int32_t *w = p.words + t.base;
    const int64_t S = t.states, L = t.list_len, W = (p.vocab + 31u) / 32u;
    const int32_t *list_start = w, *tokens = w + S + 1, *next = tokens + L, *dflt = next + L, *mask_at = dflt + S;
    const uint32_t *masks = (const uint32_t *)(mask_at + S);
    bool bad = threadIdx.x == 0 && (list_start[0] != 0 || list_start[S] != L);
    uint32_t seen_dense = 0;
    for (int64_t s = threadIdx.x; s < S; s += blockDim.x) bad |= list_start[s] > list_start[s + 1];
    for (int64_t i = threadIdx.x; i < L; i += blockDim.x) {
        bad |= tokens[i] < 0 || (uint32_t)tokens[i] >= p.vocab || next[i] < 0 || next[i] >= S;
        if (i + 1 < L && tokens[i] >= tokens[i + 1]) bad |= !list_starts_at(list_start, S, i + 1);
    }
    for (int64_t s = threadIdx.x; s < S; s += blockDim.x) {
        const int32_t m = mask_at[s], d = dflt[s];
        bool allows = list_start[s] < list_start[s + 1];
        if (m == DPUF_AUTOMATON_NONE) {
            bad |= d != DPUF_AUTOMATON_NONE;
        } else if (m < 0 || m % W != 0 || m / W >= (int64_t)t.dense || d < 0 || d >= S) {
            bad = true;
        } else {
            seen_dense++;
            /* No bit past the vocabulary (the walk would not read it: a state whose
             * only bits lie there would allow nothing). */
            const uint32_t tail = p.vocab % 32u;
            if (tail) bad |= (masks[m + W - 1] & ~((1u << tail) - 1u)) != 0;
            for (int64_t j = 0; j < W && !allows; j++) allows = masks[m + j] != 0;
        }
        bad |= !allows;
    }
    if (seen_dense) atomicAdd(dense, seen_dense);
    bad = __syncthreads_or(bad);
    return bad || *dense != t.dense;
}

/* All threads: a fresh automaton (automata_take's `fresh`) copied from `at`, its
 * arena span, into its slot, then checked (automaton_faulty). True: it fails. */
__device__ bool automaton_copy_faulty(const automaton_pool &p, const automaton_slot &t, const uint8_t *at,
                                      uint32_t *dense) {
    copy_prompt((const uint32_t *)(at + DPUF_AUTOMATON_HEADER_SIZE), (uint32_t *)(p.words + t.base),
                (t.bytes - DPUF_AUTOMATON_HEADER_SIZE) / 4u);
    __syncthreads();
    return automaton_faulty(p, t, dense);
}

#endif /* DPUF_AUTOMATON_POOL_CUH */
