/* A minimal test harness for the C tests: counts failures, prints the first few. */
#ifndef OPFORGE_TEST_CHECK_H
#define OPFORGE_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

static int check_failures, check_count;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        check_count++;                                                                             \
        if (!(cond)) {                                                                             \
            if (check_failures++ < 20) {                                                           \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                               \
                fprintf(stderr, __VA_ARGS__);                                                      \
                fputc('\n', stderr);                                                               \
            }                                                                                      \
        }                                                                                          \
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

#endif
