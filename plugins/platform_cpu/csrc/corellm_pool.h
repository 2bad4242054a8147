/* corellm's CPU thread pool: the one set of threads every native library of the CPU platform
 * runs its parallel loops on (the platform's GEMM and element-wise kernels, and the kernels a
 * plugin builds with Platform.native_library, such as the torch_sdpa plugin's paged attention).
 *
 * Why not OpenMP: an OpenMP parallel region ends in a barrier that every thread of the team must
 * reach, and `schedule(static)` hands each thread its share in advance, so on a machine where a
 * thread has lost its core to another process (a busy neighbour, a CPU quota) every region
 * waits for that thread to be scheduled again, several hundred times a step; and libgomp's
 * idle threads spin for a long while before they sleep, taking the very core the descheduled
 * thread needs. Here a loop's items are claimed a chunk at a time from a shared counter by
 * whichever threads are running, the caller included, and the call returns when the items are
 * done: a thread that wakes late finds nothing left and goes back to sleep, and no one waits for
 * it. An idle thread spins for a bounded time and then sleeps: about twice the recent gap between
 * loops (so the threads stay awake through a burst of loops, a model's layers, and sleep between
 * bursts), at least what a wake-up costs (measured at start) and at most 200 us.
 *
 * The pool is one shared library of the platform (pool.c), loaded into the process's global
 * symbol scope before any kernel library, so every library that includes this header calls the
 * same pool. It is safe to call from several threads (calls take turns) and from inside a loop
 * body (the nested loop runs on the calling thread); a child process after fork starts its own
 * threads.
 */
#ifndef CORELLM_POOL_H
#define CORELLM_POOL_H

#include <stdint.h>

/* A loop body: items [begin, end) of the loop, on thread `tid` (0 is the caller; ids are below
 * corellm_pool_threads(), for per-thread scratch). */
typedef void (*corellm_body_fn)(void *ctx, int64_t begin, int64_t end, int tid);

/* Runs body over items [0, n): in one call on the calling thread when n <= grain or the pool has
 * one thread, else in chunks of at least `grain` items claimed by the pool's threads as they come.
 * Returns when every item is done. */
void corellm_parallel_for(int64_t n, int64_t grain, corellm_body_fn body, void *ctx);

/* The threads a loop may run on, the caller included (what corellm_pool_configure set). */
int corellm_pool_threads(void);

/* Memory the next loops will read (the next layers' weights): n ranges (address, bytes), at most
 * CORELLM_WARM_RANGES, that an idle worker fetches into the caches between loops, in order,
 * pausing while a loop runs. Replaces the ranges given before (n = 0: none). Copied: the array
 * may be reused at once. A pool of one thread ignores it. */
#define CORELLM_WARM_RANGES 4
void corellm_pool_warm(const int64_t *ranges, int n);

#endif
