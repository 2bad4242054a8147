/* corellm's CPU thread pool (corellm_pool.h says why it is not OpenMP).
 *
 * One loop runs at a time. Its items are claimed from a single 64-bit ticket: the loop's
 * generation in the high 32 bits (odd while the caller writes the loop's parameters, even while
 * the loop runs) and the next unclaimed item in the low 32. A thread reads the ticket, then the
 * parameters, then claims a chunk with a compare-and-swap on the ticket it read: the swap fails
 * if another loop began meanwhile, so a thread that was descheduled for a while never runs a
 * chunk of the wrong loop with the parameters of another (a sequence lock, the ticket being its
 * sequence). The caller counts finished items, not threads: it returns once every item is done,
 * whatever the threads that claimed none are doing.
 *
 * Waiting threads (workers between loops, the caller for the last chunks) spin for a bounded
 * time (spin_now_ns: about twice the recent gap between loops, at least spin_ns, the measured
 * cost of a wake-up, at most SPIN_MAX_NS), then sleep on a condition variable; a loop wakes
 * sleeping workers, and the thread that finishes its last chunk wakes a sleeping caller.
 *
 * While it spins, worker 1 fetches the memory ranges the last corellm_pool_warm gave (the next
 * layers' weights) with prefetch instructions, 2 KiB between looks at the ticket, so a loop that
 * begins finds it ready at once; it drops the ranges when it goes to sleep.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "corellm_pool.h"

#define MAX_THREADS 512
/* A loop is cut into about this many chunks per thread (each at least the loop's grain): small
 * enough that the running threads share out what a descheduled one has not claimed, large enough
 * that claiming (one compare-and-swap) costs nothing beside a chunk's work. */
#define CHUNKS_PER_THREAD 8
#define MAX_ITEMS ((int64_t)1 << 31)
/* The most a waiting thread spins before it sleeps. */
#define SPIN_MAX_NS 200000

static struct {
    _Atomic uint64_t ticket;
    _Atomic uintptr_t body, ctx;
    _Atomic int64_t n, chunk;
    _Atomic int participants;
    _Atomic int64_t done;
    _Atomic int sleepers;
    _Atomic int caller_sleeping;
    _Atomic int64_t spin_ns;            /* the least a waiting thread spins: a wake-up's cost */
    _Atomic int64_t spin_now_ns;        /* what it spins now (see corellm_parallel_for) */
    int64_t gap_ns, last_end_ns;        /* the caller's gaps between loops (under `region`) */
    _Atomic int threads;
    int started;                        /* workers started (ids 1..started), under `region` */
    pthread_t workers[MAX_THREADS];
    pthread_mutex_t lock;               /* sleeping and waking */
    pthread_cond_t wake, finished;
    pthread_cond_t park;                /* workers beyond the configured count wait here */
    pthread_mutex_t region;             /* one loop at a time */
    _Atomic uint64_t loops, worker_sleeps, caller_sleeps, chunks_by_workers;
    /* memory the next loops will read, which worker 1 fetches between loops (corellm_pool_warm):
     * ranges [warm_at[i], + warm_len[i]) for i < warm_n, warm_pos bytes of them fetched */
    _Atomic uintptr_t warm_at[CORELLM_WARM_RANGES];
    _Atomic int64_t warm_len[CORELLM_WARM_RANGES];
    _Atomic int warm_n;
    _Atomic int64_t warm_pos;
    _Atomic uint64_t warmed_bytes;
} P = {
    .spin_ns = 20000,
    .spin_now_ns = 20000,
    .threads = 1,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .finished = PTHREAD_COND_INITIALIZER,
    .park = PTHREAD_COND_INITIALIZER,
    .region = PTHREAD_MUTEX_INITIALIZER,
};

static _Thread_local int in_pool;       /* a worker, or a caller inside its loop */

#define GEN(t) ((uint32_t)((t) >> 32))
#define ITEM(t) ((int64_t)((t) & 0xffffffffu))

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Claims and runs chunks of the loop whose ticket was read as t (an even generation) until
 * none is left or another loop has begun. */
static void run_chunks(uint64_t t, int tid) {
    const uint32_t gen = GEN(t);
    for (;;) {
        corellm_body_fn body = (corellm_body_fn)atomic_load_explicit(&P.body,
                                                                     memory_order_relaxed);
        void *ctx = (void *)atomic_load_explicit(&P.ctx, memory_order_relaxed);
        const int64_t n = atomic_load_explicit(&P.n, memory_order_relaxed);
        const int64_t chunk = atomic_load_explicit(&P.chunk, memory_order_relaxed);
        const int parts = atomic_load_explicit(&P.participants, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if (tid >= parts) return;
        const int64_t begin = ITEM(t);
        if (begin >= n) return;
        const int64_t end = begin + chunk < n ? begin + chunk : n;
        /* the swap succeeds only if no other loop began since t was read, so the parameters
         * read above are this loop's */
        if (!atomic_compare_exchange_weak(&P.ticket, &t, ((uint64_t)gen << 32) | (uint64_t)end)) {
            if (GEN(t) != gen) return;
            continue;
        }
        body(ctx, begin, end, tid);
        if (tid) atomic_fetch_add_explicit(&P.chunks_by_workers, 1, memory_order_relaxed);
        if (atomic_fetch_add(&P.done, end - begin) + (end - begin) == n
                && atomic_load(&P.caller_sleeping)) {
            pthread_mutex_lock(&P.lock);
            pthread_cond_signal(&P.finished);
            pthread_mutex_unlock(&P.lock);
        }
        t = atomic_load(&P.ticket);
        if (GEN(t) != gen) return;
    }
}

/* Fetches into this core's caches, until a loop begins, what is left of the ranges
 * corellm_pool_warm gave, 2 KiB at a time: prefetches, not loads, so memory freed meanwhile
 * does not fault, and a range replaced while it is read costs a few wasted fetches at worst. */
static void warm_some(uint32_t seen) {
    for (;;) {
        const uint64_t t = atomic_load_explicit(&P.ticket, memory_order_relaxed);
        if (GEN(t) != seen && !(GEN(t) & 1)) return;           /* a loop has begun */
        const int n = atomic_load_explicit(&P.warm_n, memory_order_acquire);
        int64_t pos = atomic_load_explicit(&P.warm_pos, memory_order_relaxed), off = pos;
        int r = 0;
        for (; r < n; ++r) {
            const int64_t len = atomic_load_explicit(&P.warm_len[r], memory_order_relaxed);
            if (off < len) break;
            off -= len;
        }
        if (r >= n) return;
        const int64_t left = atomic_load_explicit(&P.warm_len[r], memory_order_relaxed) - off;
        const int64_t step = left < 2048 ? left : 2048;
        if (!atomic_compare_exchange_weak(&P.warm_pos, &pos, pos + step)) continue;
        const char *p = (const char *)atomic_load_explicit(&P.warm_at[r],
                                                           memory_order_relaxed) + off;
        for (int64_t i = 0; i < step; i += 64) __builtin_prefetch(p + i, 0, 2);
        atomic_fetch_add_explicit(&P.warmed_bytes, (uint64_t)step, memory_order_relaxed);
    }
}

void corellm_pool_warm(const int64_t *ranges, int n) {
    if (n > CORELLM_WARM_RANGES) n = CORELLM_WARM_RANGES;
    atomic_store_explicit(&P.warm_n, 0, memory_order_relaxed);
    if (!ranges || n <= 0 || atomic_load_explicit(&P.threads, memory_order_relaxed) < 2) return;
    for (int i = 0; i < n; ++i) {
        atomic_store_explicit(&P.warm_at[i], (uintptr_t)ranges[2 * i], memory_order_relaxed);
        atomic_store_explicit(&P.warm_len[i], ranges[2 * i + 1], memory_order_relaxed);
    }
    atomic_store_explicit(&P.warm_pos, 0, memory_order_relaxed);
    atomic_store_explicit(&P.warm_n, n, memory_order_release);
}

static void *worker_main(void *arg) {
    const int tid = (int)(intptr_t)arg;
    uint32_t seen = GEN(atomic_load(&P.ticket));
    in_pool = 1;
    for (;;) {
        if (tid >= atomic_load(&P.threads)) {     /* not needed now: neither spin nor wake */
            pthread_mutex_lock(&P.lock);
            while (tid >= atomic_load(&P.threads))
                pthread_cond_wait(&P.park, &P.lock);
            pthread_mutex_unlock(&P.lock);
            seen = GEN(atomic_load(&P.ticket));
            continue;
        }
        uint64_t t = atomic_load(&P.ticket);
        if (GEN(t) == seen || (GEN(t) & 1)) {
            const int64_t spin = atomic_load_explicit(&P.spin_now_ns, memory_order_relaxed);
            const int64_t until = now_ns() + spin;
            for (int i = 1;; ++i) {
                cpu_relax();
                if (tid == 1) warm_some(seen);
                t = atomic_load(&P.ticket);
                if (GEN(t) != seen && !(GEN(t) & 1)) break;
                if ((i & 31) == 0 && now_ns() >= until) {
                    atomic_store(&P.warm_n, 0);         /* stale by the time it wakes */
                    pthread_mutex_lock(&P.lock);
                    atomic_fetch_add(&P.sleepers, 1);
                    atomic_fetch_add_explicit(&P.worker_sleeps, 1, memory_order_relaxed);
                    while (t = atomic_load(&P.ticket), GEN(t) == seen || (GEN(t) & 1))
                        pthread_cond_wait(&P.wake, &P.lock);
                    atomic_fetch_sub(&P.sleepers, 1);
                    pthread_mutex_unlock(&P.lock);
                    break;
                }
            }
        }
        seen = GEN(t);
        run_chunks(t, tid);
    }
    return NULL;
}

/* Starts workers up to threads - 1 (ids 1..threads-1), and returns the threads a loop may run
 * on now (fewer if a thread could not be started); with the region lock held. */
static int start_workers(int threads) {
    while (P.started < threads - 1) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int id = P.started + 1;
        const int rc = pthread_create(&P.workers[id], &attr, worker_main, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (rc) break;                    /* run with the threads there are */
        P.started = id;
    }
    return P.started + 1 < threads ? P.started + 1 : threads;
}

typedef struct { corellm_body_fn body; void *ctx; int64_t off; } slice_t;

static void slice_body(void *c, int64_t begin, int64_t end, int tid) {
    const slice_t *s = c;
    s->body(s->ctx, s->off + begin, s->off + end, tid);
}

void corellm_parallel_for(int64_t n, int64_t grain, corellm_body_fn body, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    const int threads = atomic_load_explicit(&P.threads, memory_order_relaxed);
    if (threads <= 1 || n <= grain || in_pool) {
        body(ctx, 0, n, 0);
        return;
    }
    if (n >= MAX_ITEMS) {                 /* the ticket holds 32 bits of items: in slices */
        for (int64_t b = 0; b < n; b += MAX_ITEMS / 2) {
            slice_t s = {body, ctx, b};
            corellm_parallel_for(n - b < MAX_ITEMS / 2 ? n - b : MAX_ITEMS / 2, grain,
                                 slice_body, &s);
        }
        return;
    }
    pthread_mutex_lock(&P.region);
    in_pool = 1;
    /* A waiting thread spins for about twice the recent gap between loops (an average of the
     * gaps, each counted up to SPIN_MAX_NS), at least a wake-up's cost: within a burst of
     * loops (a model's layers) the threads stay awake, and between bursts they sleep. */
    const int64_t start = now_ns();
    if (P.last_end_ns) {
        int64_t gap = start - P.last_end_ns;
        if (gap > SPIN_MAX_NS) gap = SPIN_MAX_NS;
        P.gap_ns += (gap - P.gap_ns) / 8;
        int64_t spin = 2 * P.gap_ns, floor = atomic_load_explicit(&P.spin_ns,
                                                                  memory_order_relaxed);
        spin = spin < floor ? floor : spin > SPIN_MAX_NS ? SPIN_MAX_NS : spin;
        atomic_store_explicit(&P.spin_now_ns, spin, memory_order_relaxed);
    }
    const int parts = start_workers(threads);
    int64_t chunk = (n + (int64_t)parts * CHUNKS_PER_THREAD - 1) / ((int64_t)parts * CHUNKS_PER_THREAD);
    if (chunk < grain) chunk = grain;
    const uint32_t gen = GEN(atomic_load(&P.ticket));         /* even: no loop is being set up */
    atomic_store(&P.ticket, (uint64_t)(gen + 1) << 32);       /* closed while written */
    atomic_store_explicit(&P.body, (uintptr_t)body, memory_order_relaxed);
    atomic_store_explicit(&P.ctx, (uintptr_t)ctx, memory_order_relaxed);
    atomic_store_explicit(&P.n, n, memory_order_relaxed);
    atomic_store_explicit(&P.chunk, chunk, memory_order_relaxed);
    atomic_store_explicit(&P.participants, parts, memory_order_relaxed);
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    const uint64_t t = (uint64_t)(gen + 2) << 32;
    atomic_store(&P.ticket, t);                               /* open (seq_cst: a release) */
    atomic_fetch_add_explicit(&P.loops, 1, memory_order_relaxed);
    if (atomic_load(&P.sleepers)) {
        pthread_mutex_lock(&P.lock);
        pthread_cond_broadcast(&P.wake);
        pthread_mutex_unlock(&P.lock);
    }
    run_chunks(t, 0);
    if (atomic_load(&P.done) != n) {      /* chunks still running on other threads */
        const int64_t until = now_ns() + atomic_load_explicit(&P.spin_now_ns,
                                                              memory_order_relaxed);
        for (int i = 1; atomic_load(&P.done) != n; ++i) {
            cpu_relax();
            if ((i & 31) == 0 && now_ns() >= until) {
                pthread_mutex_lock(&P.lock);
                atomic_store(&P.caller_sleeping, 1);
                atomic_fetch_add_explicit(&P.caller_sleeps, 1, memory_order_relaxed);
                while (atomic_load(&P.done) != n)
                    pthread_cond_wait(&P.finished, &P.lock);
                atomic_store(&P.caller_sleeping, 0);
                pthread_mutex_unlock(&P.lock);
                break;
            }
        }
    }
    P.last_end_ns = now_ns();
    in_pool = 0;
    pthread_mutex_unlock(&P.region);
}

int corellm_pool_threads(void) { return atomic_load(&P.threads); }
uint64_t corellm_pool_warmed_bytes(void) { return atomic_load(&P.warmed_bytes); }

/* Sets the threads loops run on (the caller included; at least 1) and the least a waiting thread
 * spins before it sleeps (spin_ns < 0: unchanged; it spins longer while loops come close
 * together, up to SPIN_MAX_NS). Workers start on the first loop that needs them; a smaller
 * count parks the others (they neither spin nor wake for loops until the count grows again). */
void corellm_pool_configure(int threads, int64_t spin_ns) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    pthread_mutex_lock(&P.lock);
    atomic_store(&P.threads, threads);
    pthread_cond_broadcast(&P.park);
    pthread_mutex_unlock(&P.lock);
    if (spin_ns >= 0) {
        atomic_store(&P.spin_ns, spin_ns);
        atomic_store(&P.spin_now_ns, spin_ns);
    }
}

int64_t corellm_pool_spin_ns(void) { return atomic_load(&P.spin_ns); }
int64_t corellm_pool_spin_now_ns(void) { return atomic_load(&P.spin_now_ns); }

/* Counters since load: loops run on the pool, chunks run by workers, worker and caller sleeps. */
void corellm_pool_stats(uint64_t out[4]) {
    out[0] = atomic_load(&P.loops);
    out[1] = atomic_load(&P.chunks_by_workers);
    out[2] = atomic_load(&P.worker_sleeps);
    out[3] = atomic_load(&P.caller_sleeps);
}

/* The median time, in ns, from signalling a condition variable to the sleeping thread running:
 * half a round trip between two threads that sleep in turn (`rounds` trips). */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int turn, rounds;
} PP = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};

static void *pong(void *arg) {
    (void)arg;
    pthread_mutex_lock(&PP.lock);
    for (int i = 0; i < PP.rounds; ++i) {
        while (PP.turn != 1) pthread_cond_wait(&PP.cond, &PP.lock);
        PP.turn = 0;
        pthread_cond_signal(&PP.cond);
    }
    pthread_mutex_unlock(&PP.lock);
    return NULL;
}

static int cmp64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int64_t corellm_pool_wake_ns(int rounds) {
    if (rounds < 1) rounds = 1;
    if (rounds > 1000) rounds = 1000;
    int64_t trips[1000];
    pthread_t th;
    PP.turn = 0;
    PP.rounds = rounds;
    if (pthread_create(&th, NULL, pong, NULL)) return -1;
    pthread_mutex_lock(&PP.lock);
    for (int i = 0; i < rounds; ++i) {
        const int64_t t0 = now_ns();
        PP.turn = 1;
        pthread_cond_signal(&PP.cond);
        while (PP.turn != 0) pthread_cond_wait(&PP.cond, &PP.lock);
        trips[i] = now_ns() - t0;
    }
    pthread_mutex_unlock(&PP.lock);
    pthread_join(th, NULL);
    qsort(trips, (size_t)rounds, sizeof trips[0], cmp64);
    return trips[rounds / 2] / 2;
}

/* A child process after fork has none of the parent's workers: it starts its own. */
static void after_fork_child(void) {
    const uint64_t t = atomic_load(&P.ticket);
    if (GEN(t) & 1)                       /* forked while a loop was being set up */
        atomic_store(&P.ticket, (uint64_t)(GEN(t) + 1) << 32);
    P.started = 0;
    P.last_end_ns = 0;
    atomic_store(&P.sleepers, 0);
    atomic_store(&P.caller_sleeping, 0);
    pthread_mutex_init(&P.lock, NULL);
    pthread_mutex_init(&P.region, NULL);
    pthread_cond_init(&P.wake, NULL);
    pthread_cond_init(&P.finished, NULL);
    pthread_cond_init(&P.park, NULL);
    in_pool = 0;
}

__attribute__((constructor)) static void pool_init(void) {
    pthread_atfork(NULL, NULL, after_fork_child);
}
