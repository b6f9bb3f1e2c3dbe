#define _POSIX_C_SOURCE 200809L /* sysconf, pthreads */
/*
 * parallel_for. Inside PyTorch the glue installs a backend over
 * torch_parallel_for (torch's intra-op pool, so torch.set_num_threads holds and
 * no second thread pool competes for the cores). Standalone (the C tests) the
 * default backend starts pthreads per call: simple, and only tests use it.
 */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "opforge/runtime.h"

typedef struct chunk {
    int64_t begin, end;
    opf_range_fn fn;
    void *ctx;
} chunk;

static void *run_chunk(void *arg) {
    chunk *c = arg;
    c->fn(c->begin, c->end, c->ctx);
    return NULL;
}

static int pthread_num_threads(void) {
    const char *env = getenv("OPFORGE_NUM_THREADS");
    long n = env ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (n > 256) n = 256;
    return (int)n;
}

static void pthread_parallel_for(int64_t begin, int64_t end, int64_t grain, opf_range_fn fn, void *ctx) {
    int64_t range = end - begin;
    if (range <= 0) return;
    if (grain < 1) grain = 1;
    int64_t nchunks = (range + grain - 1) / grain;
    int nt = pthread_num_threads();
    if (nchunks > nt) nchunks = nt;
    if (nchunks <= 1) {
        fn(begin, end, ctx);
        return;
    }
    chunk chunks[256];
    pthread_t tids[256];
    int started[256] = {0};
    int64_t step = (range + nchunks - 1) / nchunks;
    for (int64_t i = 0; i < nchunks; i++) {
        int64_t b = begin + i * step, e = b + step < end ? b + step : end;
        chunks[i] = (chunk){b, e, fn, ctx};
    }
    for (int64_t i = 1; i < nchunks; i++) started[i] = pthread_create(&tids[i], NULL, run_chunk, &chunks[i]) == 0;
    run_chunk(&chunks[0]);
    for (int64_t i = 1; i < nchunks; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
        else
            run_chunk(&chunks[i]); /* could not start a thread: do the work here */
    }
}

static const opf_parallel_backend pthread_backend = {pthread_parallel_for, pthread_num_threads};
static const opf_parallel_backend *backend = &pthread_backend;

void opf_parallel_set_backend(const opf_parallel_backend *b) { backend = b ? b : &pthread_backend; }

/* A chunk run for the thread that called opf_parallel_for, at info level: the kernels it picks or falls
 * back to are noted into that thread's record, for its call's log line. */
typedef struct logged_job {
    opf_range_fn fn;
    void *ctx;
    opf_log_record *record;
} logged_job;

static void logged_chunk(int64_t begin, int64_t end, void *arg) {
    const logged_job *j = arg;
    opf_log_record *before = opf_log_record_use(j->record);
    j->fn(begin, end, j->ctx);
    opf_log_record_use(before);
}

void opf_parallel_for(int64_t begin, int64_t end, int64_t grain, opf_range_fn fn, void *ctx) {
    if (end <= begin) return;
    if (end - begin <= grain) {
        fn(begin, end, ctx); /* small: no pool round trip */
        return;
    }
    if (opf_log_enabled(OPF_LOG_INFO)) {
        logged_job j = {fn, ctx, opf_log_record_current()};
        backend->parallel_for(begin, end, grain, logged_chunk, &j);
        return;
    }
    backend->parallel_for(begin, end, grain, fn, ctx);
}

int opf_num_threads(void) { return backend->num_threads(); }
