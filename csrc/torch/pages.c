/*
 * How an op's large fresh CPU output is paged in before its kernel writes it (OPFORGE_PAGES):
 * opf_empty_strided (glue.c) calls opf_page_in on every output it makes.
 */
#define _DEFAULT_SOURCE 1 /* madvise's MADV_HUGEPAGE, mincore */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "pages.h"

/* A CPU output of OPF_FRESH_BYTES or more often arrives unpaged: glibc's malloc maps a block above
 * its mmap threshold (which rises with use to 32 MiB at most) fresh on every allocation and gives
 * back the top of its heap past its trim threshold, and the op's first writes then fault the memory
 * in 4 KiB at a time, at a cost that can exceed the op's own work (a 180 MiB SwiGLU output: ~46000
 * faults, ~50 ms of a 2-core VM's time). Where the buffer is fresh (its first, middle and last pages
 * not resident: mincore), the mode says what the op does before its kernel writes it:
 *   touch:    nothing; the kernel's writes fault the pages in, as eager's ops do.
 *   populate: (the default) the threads fault the pages in first, in parallel, a 2 MiB range each
 *             (MADV_POPULATE_WRITE, Linux 5.14): the kernel zeroes and maps them without a trap per
 *             page (1.3x faster than touching them, same pages, same memory).
 *   huge:     transparent huge pages are advised for the buffer's 2 MiB-aligned interior, then it is
 *             populated: one fault per 2 MiB (2.5x faster than touching here). Not the default: on
 *             a VM a huge page the guest has not used before can cost the host's first touch of the
 *             whole 2 MiB (0.6-0.7 ms a page was measured on one, a call 10x slower until the
 *             process recycled its huge pages), and where THP's defrag is "madvise" a fault may wait
 *             for compaction.
 * Values never change; the mode is OPFORGE_PAGES or opforge_set_pages. */
#define OPF_FRESH_BYTES (4ull << 20)
enum { PAGES_TOUCH, PAGES_POPULATE, PAGES_HUGE };
static const char *const pages_names[] = {"touch", "populate", "huge"};
static int pages_mode = PAGES_POPULATE; /* atomic access */
static int populate_works = 1;          /* cleared when the kernel refuses MADV_POPULATE_WRITE */

static int pages_of(const char *name) {
    for (int i = 0; i < 3; i++)
        if (strcmp(name, pages_names[i]) == 0) return i;
    return -1;
}

OPF_EXPORT int opforge_set_pages(const char *name, char *err, size_t errlen) {
    const int m = pages_of(name);
    if (m < 0) {
        snprintf(err, errlen, "pages mode '%s': expected one of touch, populate, huge", name);
        return -1;
    }
    __atomic_store_n(&pages_mode, m, __ATOMIC_RELAXED);
    return 0;
}

OPF_EXPORT const char *opforge_pages(void) { return pages_names[__atomic_load_n(&pages_mode, __ATOMIC_RELAXED)]; }

int opf_pages_init(char *err, size_t errlen) {
    const char *env = getenv("OPFORGE_PAGES");
    if (!env || !env[0]) return 0;
    if (opforge_set_pages(env, err, errlen) == 0) return 0;
    snprintf(err, errlen, "OPFORGE_PAGES=%s is not a pages mode; expected one of touch, populate, huge", env);
    return -1;
}

#if defined(__linux__) && defined(MADV_HUGEPAGE)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels answer EINVAL */
#endif
#define OPF_PAGE_CHUNK ((uintptr_t)2 << 20)

typedef struct populate_job {
    uintptr_t lo, hi; /* page-aligned */
} populate_job;

static void populate_range(int64_t begin, int64_t end, void *ctx) {
    const populate_job *j = ctx;
    for (int64_t c = begin; c < end && __atomic_load_n(&populate_works, __ATOMIC_RELAXED); c++) {
        const uintptr_t base = (j->lo & ~(OPF_PAGE_CHUNK - 1)) + (uintptr_t)c * OPF_PAGE_CHUNK; /* chunk c, clipped */
        const uintptr_t a = base < j->lo ? j->lo : base,
                        b = base + OPF_PAGE_CHUNK > j->hi ? j->hi : base + OPF_PAGE_CHUNK;
        if (b > a && madvise((void *)a, b - a, MADV_POPULATE_WRITE) != 0 && errno == EINVAL)
            __atomic_store_n(&populate_works, 0, __ATOMIC_RELAXED);
    }
}
#endif

void opf_page_in(AtenTensorHandle out, int64_t ndim, const int64_t *sizes, const int64_t *strides, int32_t dtype) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const int mode = __atomic_load_n(&pages_mode, __ATOMIC_RELAXED);
    if (mode == PAGES_TOUCH) return;
    uint64_t span = 1;
    for (int64_t d = 0; d < ndim; d++) {
        if (sizes[d] == 0) return;
        span += (uint64_t)(sizes[d] - 1) * (uint64_t)(strides[d] < 0 ? -strides[d] : strides[d]);
    }
    const uint64_t bytes = span * aoti_torch_dtype_element_size(dtype);
    void *data = NULL;
    if (bytes < OPF_FRESH_BYTES || aoti_torch_get_data_ptr(out, &data) != OPF_AOTI_SUCCESS || !data) return;
    const uintptr_t page = 4096, lo = ((uintptr_t)data + page - 1) & ~(page - 1),
                    hi = ((uintptr_t)data + bytes) & ~(page - 1);
    /* fresh: its first, middle and last pages not resident (a new mapping, or the heap's new top).
     * Memory glibc reuses is mostly resident, and populating it walks every page for a few fresh ones
     * (a 22 MiB output with 2 MiB fresh: 20% slower than touching) */
    const uintptr_t probe[3] = {lo, lo + ((hi - lo) / 2 & ~(page - 1)), hi - page};
    for (int i = 0; i < 3; i++) {
        unsigned char resident = 1;
        if (mincore((void *)probe[i], page, &resident) != 0 || (resident & 1)) return;
    }
    if (mode == PAGES_HUGE) {
        const uintptr_t hlo = (lo + OPF_PAGE_CHUNK - 1) & ~(OPF_PAGE_CHUNK - 1), hhi = hi & ~(OPF_PAGE_CHUNK - 1);
        if (hhi > hlo) (void)madvise((void *)hlo, hhi - hlo, MADV_HUGEPAGE);
    }
    if (!__atomic_load_n(&populate_works, __ATOMIC_RELAXED)) return;
    populate_job j = {lo, hi};
    const int64_t chunks = (int64_t)(((hi - 1) >> 21) - (lo >> 21) + 1);
    opf_parallel_for(0, chunks, 1, populate_range, &j);
#else
    (void)out, (void)ndim, (void)sizes, (void)strides, (void)dtype;
#endif
}
