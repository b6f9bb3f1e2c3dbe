/*
 * Page-fault cost of fresh outputs. A new 256 MB tensor is 65,536 4-KiB page
 * faults on first touch, which costs more than the arithmetic of a streaming
 * op. With transparent huge pages in "madvise" mode, MADV_HUGEPAGE turns them
 * into 128 2-MiB faults. Only buffers above glibc's largest mmap threshold
 * (32 MiB) are hinted: those are private mappings that die with the tensor,
 * so no huge page is left behind in the heap.
 */
#define _DEFAULT_SOURCE
#include <stdint.h>
#include <sys/mman.h>

#include "opforge/runtime.h"

#define HUGE_PAGE ((uintptr_t)2 << 20)
#define HINT_MIN_BYTES ((size_t)32 << 20)

void opf_hint_fresh_output(void *data, size_t bytes) {
#ifdef MADV_HUGEPAGE
    if (bytes < HINT_MIN_BYTES) return;
    uintptr_t begin = ((uintptr_t)data + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    uintptr_t end = ((uintptr_t)data + bytes) & ~(HUGE_PAGE - 1);
    if (end > begin) (void)madvise((void *)begin, end - begin, MADV_HUGEPAGE); /* a hint: failure is fine */
#else
    (void)data, (void)bytes;
#endif
}
