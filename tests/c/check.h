/* A minimal test harness for the C tests: counts failures, prints the first few. */
#ifndef OPFORGE_TEST_CHECK_H
#define OPFORGE_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "opforge/runtime.h"

static int check_failures, check_count;

#define CHECK(cond, ...)                                             \
    do {                                                             \
        check_count++;                                               \
        if (!(cond)) {                                               \
            if (check_failures++ < 20) {                             \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                        \
                fputc('\n', stderr);                                 \
            }                                                        \
        }                                                            \
    } while (0)

static inline int check_report(const char *name) {
    printf("%s: %d checks, %d failures\n", name, check_count, check_failures);
    return check_failures ? 1 : 0;
}

/* xorshift: reproducible inputs without libc's rand */
static inline double check_uniform(unsigned long long *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (double)(*s >> 11) / 9007199254740992.0;
}

/* Workspace with guard words: check_ws_alloc(n) returns n floats, filled
 * with NaN so a kernel that reads what it did not write shows it, between two
 * runs of CHECK_GUARD words; check_ws_free checks the guards (a write past
 * either end fails the test) and frees. Every workspace a test hands a kernel
 * comes from here, sized exactly as the kernel's size function says. */
enum { CHECK_GUARD = 64 };
#define CHECK_GUARD_WORD(i) (0x7fa5c3e1u ^ (unsigned)(i))

static inline float *check_ws_alloc(int64_t n) {
    if (n < 0) n = 0;
    int64_t *head = malloc(2 * sizeof(int64_t) + (size_t)(n + 2 * CHECK_GUARD) * sizeof(float));
    head[0] = n;
    unsigned *w = (unsigned *)(head + 2);
    for (int64_t i = 0; i < CHECK_GUARD; i++) w[i] = w[CHECK_GUARD + n + i] = CHECK_GUARD_WORD(i);
    for (int64_t i = 0; i < n; i++) w[CHECK_GUARD + i] = 0x7fc00000u; /* quiet NaN */
    return (float *)(w + CHECK_GUARD);
}

static inline void check_ws_free(float *ws, const char *what) {
    if (!ws) return;
    unsigned *w = (unsigned *)ws - CHECK_GUARD;
    int64_t *head = (int64_t *)w - 2, n = head[0], before = 0, after = 0;
    for (int64_t i = 0; i < CHECK_GUARD; i++) {
        before += w[i] != CHECK_GUARD_WORD(i);
        after += w[CHECK_GUARD + n + i] != CHECK_GUARD_WORD(i);
    }
    CHECK(before == 0 && after == 0,
          "%s: workspace of %lld floats written outside: %lld guard words before it, %lld after", what, (long long)n,
          (long long)before, (long long)after);
    free(head);
}

/* Makes isa current for a test's variant loop; says why and returns 0 when this CPU lacks it. */
static inline int check_use_isa(int isa) {
    char err[256];
    if (opf_isa_set(opf_isa_name((opf_isa)isa), err, sizeof err) == 0) return 1;
    printf("skip %s: %s\n", opf_isa_name((opf_isa)isa), err);
    return 0;
}

/* The variant loop of a kernel test: TEST(k) for each ISA this CPU runs, k =
 * KERNELS_FOR(isa) (a table with a `name`). An ISA without a variant of its
 * own gets an earlier ISA's table: that is reported, not tested again. */
#define CHECK_EACH_VARIANT(KERNELS_FOR, TEST)                                                 \
    do {                                                                                      \
        int tested_ = 0;                                                                      \
        for (int isa_ = 0; isa_ < OPF_ISA_COUNT; isa_++) {                                    \
            if (!check_use_isa(isa_)) continue;                                               \
            if (isa_ > 0 && KERNELS_FOR((opf_isa)isa_) == KERNELS_FOR((opf_isa)(isa_ - 1))) { \
                printf("%s: no variant of its own, uses %s\n", opf_isa_name((opf_isa)isa_),   \
                       KERNELS_FOR((opf_isa)isa_)->name);                                     \
                continue;                                                                     \
            }                                                                                 \
            TEST(KERNELS_FOR((opf_isa)isa_));                                                 \
            printf("tested %s\n", KERNELS_FOR((opf_isa)isa_)->name);                          \
            tested_++;                                                                        \
        }                                                                                     \
        CHECK(tested_ >= 1, "no variant tested");                                             \
    } while (0)

#endif
