/* Runtime: ISA selection errors, n-d coalescing and int64 offsets, dense
 * layouts, half conversions, parallel_for coverage. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "opforge/half.h"
#include "check.h"
#include "opforge/runtime.h"

static void test_isa(void) {
    char err[512] = "";
    CHECK(opf_isa_set("bogus", err, sizeof err) == -1, "unknown ISA accepted");
    CHECK(strstr(err, "auto, ref, avx2, avx512, avx512_bf16, amx") != NULL, "message lacks the valid names: %s", err);
    CHECK(opf_isa_set("ref", err, sizeof err) == 0 && opf_isa_current() == OPF_ISA_REF, "ref refused");
    CHECK(opf_isa_set("auto", err, sizeof err) == 0 && opf_isa_current() == opf_isa_best(), "auto is not the best ISA");
    for (int i = opf_isa_best() + 1; i < OPF_ISA_COUNT; i++) {
        CHECK(opf_isa_set(opf_isa_name((opf_isa)i), err, sizeof err) == -1, "%s accepted on a CPU without it",
              opf_isa_name((opf_isa)i));
        CHECK(strstr(err, "not supported by this CPU") != NULL, "unclear message: %s", err);
    }
    char level_err[256] = "";
    CHECK(opf_log_set_level("loud", level_err, sizeof level_err) == -1 &&
              strstr(level_err, "error, warning, info, debug"),
          "bad log level: %s", level_err);
}

typedef struct seg_log {
    int n;
    int64_t off[8][2], stride[8][2], len[8];
} seg_log;

static void record(void *ctx, const int64_t *off, const int64_t *stride, int64_t n) {
    seg_log *l = ctx;
    if (l->n < 8) {
        memcpy(l->off[l->n], off, 2 * sizeof *off);
        memcpy(l->stride[l->n], stride, 2 * sizeof *stride);
        l->len[l->n] = n;
    }
    l->n++;
}

static void test_nd(void) {
    opf_nd nd;
    /* contiguous collapses to one dim */
    int64_t s3[] = {2, 3, 4}, c3[] = {12, 4, 1};
    const int64_t *st[] = {c3, c3};
    opf_nd_init(&nd, 3, s3, 2, st);
    CHECK(nd.ndim == 1 && nd.size[0] == 24 && nd.stride[1][0] == 1, "contiguous not merged: ndim %d", nd.ndim);
    /* transposed output and input with the same strides: also one dim */
    int64_t s2[] = {3, 4}, t2[] = {1, 3};
    const int64_t *tt[] = {t2, t2};
    opf_nd_init(&nd, 2, s2, 2, tt);
    CHECK(nd.ndim == 1 && nd.size[0] == 12, "dense permutation not merged: ndim %d", nd.ndim);
    /* int64 offsets past 2^31 elements, no memory touched */
    const int64_t big = ((int64_t)1 << 31) + 5;
    int64_t sb[] = {3, big}, ob[] = {big, 1}, ib[] = {1, 3};
    const int64_t *bs[] = {ob, ib};
    opf_nd_init(&nd, 2, sb, 2, bs);
    CHECK(nd.ndim == 2 && nd.numel == 3 * big, "big shape: ndim %d numel %lld", nd.ndim, (long long)nd.numel);
    seg_log log = {0};
    opf_nd_segments(&nd, big - 2, big + 5, record, &log);
    CHECK(log.n == 2, "expected 2 segments, got %d", log.n);
    CHECK(log.off[0][0] == big - 2 && log.off[0][1] == (big - 2) * 3 && log.len[0] == 2,
          "segment 0: off %lld %lld len %lld", (long long)log.off[0][0], (long long)log.off[0][1],
          (long long)log.len[0]);
    CHECK(log.off[1][0] == big && log.off[1][1] == 1 && log.len[1] == 5 && log.stride[1][1] == 3,
          "segment 1: off %lld %lld len %lld", (long long)log.off[1][0], (long long)log.off[1][1],
          (long long)log.len[1]);
    /* dense detection and output strides */
    int64_t out[3];
    CHECK(opf_is_dense(2, s2, t2), "transpose is dense");
    int64_t sl[] = {20, 1};
    CHECK(!opf_is_dense(2, (int64_t[]){7, 13}, sl), "a row slice is not dense");
    opf_output_strides(2, (int64_t[]){7, 13}, sl, out);
    CHECK(out[0] == 13 && out[1] == 1, "slice output strides %lld %lld", (long long)out[0], (long long)out[1]);
    CHECK(!opf_is_dense(2, (int64_t[]){5, 4}, (int64_t[]){0, 1}), "broadcast is not dense");
    CHECK(!opf_is_dense(2, (int64_t[]){0, 4}, (int64_t[]){4, 1}), "empty uses contiguous strides");
    opf_output_strides(3, (int64_t[]){2, 1, 3}, (int64_t[]){1, 99, 2}, out);
    CHECK(out[0] == 1 && out[1] == 99 && out[2] == 2, "dense strides copied verbatim");
}

static void test_half(void) {
    /* every f16 and bf16 bit pattern survives f16 -> f32 -> f16 */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = opf_f16_to_f32((uint16_t)h);
        uint16_t back = opf_f32_to_f16(f);
        if (isnan(f) ? (back & 0x7e00) != 0x7e00 : back != h) bad++;
        float b = opf_bf16_to_f32((uint16_t)h);
        if (!isnan(b) && opf_f32_to_bf16(b) != h) bad++;
    }
    CHECK(bad == 0, "%d 16-bit patterns do not round-trip", bad);
    /* round to nearest even at a tie, overflow to inf, subnormal rounding */
    CHECK(opf_f32_to_f16(1.0f + 1.0f / 2048) == 0x3c00, "f16 tie rounds to even");
    CHECK(opf_f32_to_f16(1.0f + 3.0f / 2048) == 0x3c02, "f16 tie rounds up to even");
    CHECK(opf_f32_to_f16(65520.0f) == 0x7c00 && opf_f32_to_f16(65519.0f) == 0x7bff, "f16 overflow");
    CHECK(opf_f32_to_f16(5.96e-8f) == 0x0001 && opf_f32_to_f16(2.0e-8f) == 0, "f16 subnormal");
    CHECK(opf_f32_to_bf16(1.0f + 1.0f / 256) == 0x3f80, "bf16 tie rounds to even");
    CHECK(opf_f32_to_bf16(NAN) == 0x7fc0, "bf16 nan");
}

static int64_t covered[1000];
static void mark(int64_t b, int64_t e, void *ctx) {
    (void)ctx;
    for (int64_t i = b; i < e; i++) covered[i]++;
}

static void test_parallel(void) {
    opf_parallel_for(0, 1000, 7, mark, NULL);
    int ok = 1;
    for (int i = 0; i < 1000; i++) ok &= covered[i] == 1;
    CHECK(ok, "parallel_for must visit every index exactly once");
    CHECK(opf_num_threads() >= 1, "thread count");
}

/* The log line names the variant a call picked, not the CPU's best ISA: picks are noted at info
 * level only, and taken (and forgotten) by the call's log line. */
typedef struct fam_table {
    OPF_VARIANT_HEAD;
} fam_table;
static const fam_table fam_ref = {"ref", OPF_ISA_REF}, fam_avx2 = {"avx2", OPF_ISA_AVX2};

static void test_variant_picks_for_the_log(void) {
    const opf_variants only_ref = OPF_VARIANTS("fam", &fam_ref, NULL), both = OPF_VARIANTS("fam", &fam_ref, &fam_avx2);
    char buf[128], err[128];
    opf_log_set_level("warning", err, sizeof err);
    double t0 = opf_now_us();
    opf_variant_pick(&both, opf_isa_best());
    CHECK(opf_log_take_picks(t0, buf, sizeof buf) == -1 && buf[0] == 0, "a pick noted below info level: %s", buf);
    opf_log_set_level("info", err, sizeof err);
    t0 = opf_now_us();
    CHECK(opf_variant_pick(&only_ref, opf_isa_best()) == &fam_ref, "a NULL entry was picked");
    opf_variant_pick(&only_ref, opf_isa_best()); /* the same table twice: named once */
    CHECK(opf_log_take_picks(t0, buf, sizeof buf) == OPF_ISA_REF && strcmp(buf, "fam:ref") == 0,
          "a library with the reference only ran it, whatever the CPU's best: got '%s'", buf);
    CHECK(opf_log_take_picks(t0, buf, sizeof buf) == -1, "picks are forgotten once taken");
    t0 = opf_now_us();
    opf_variant_pick(&both, OPF_ISA_REF);
    if (opf_isa_best() >= OPF_ISA_AVX2) opf_variant_pick(&both, OPF_ISA_AVX2);
    int isa = opf_log_take_picks(t0, buf, sizeof buf);
    CHECK(isa == (opf_isa_best() >= OPF_ISA_AVX2 ? OPF_ISA_AVX2 : OPF_ISA_REF), "highest ISA picked: %d (%s)", isa,
          buf);
    CHECK(opf_variant_best(&both, OPF_ISA_REF) == &fam_ref && opf_log_take_picks(0, buf, sizeof buf) == -1,
          "opf_variant_best chooses without noting");
    opf_log_set_level("warning", err, sizeof err);
}

/* A chunk of opf_parallel_for that falls back unless it is the first (which runs on the calling thread). */
static void fall_back_off_the_caller(int64_t b, int64_t e, void *ctx) {
    (void)e;
    if (b > 0) opf_variant_fallback(ctx, &fam_ref, "in a worker");
}

/* A fallback names the pick and what ran instead, and counts with the ISA that ran; it is noted at info
 * level only, once per call, and reaches the caller's line from a worker of opf_parallel_for. */
static void test_variant_fallbacks_for_the_log(void) {
    const opf_variants both = OPF_VARIANTS("fam", &fam_ref, &fam_avx2);
    char buf[160], err[128];
    opf_log_set_level("warning", err, sizeof err);
    double t0 = opf_now_us();
    opf_variant_fallback(&both, &fam_ref, "float64");
    CHECK(opf_log_take_picks(t0, buf, sizeof buf) == -1 && buf[0] == 0, "a fallback noted below info level: %s", buf);
    CHECK(opf_variant_or_ref(&both, &fam_avx2, NULL) == &fam_avx2 &&
              opf_variant_or_ref(&both, &fam_avx2, "float64") == &fam_ref,
          "opf_variant_or_ref runs the pick, or the reference where there is a reason");
    opf_log_set_level("info", err, sizeof err);
    t0 = opf_now_us();
    opf_log_note_pick("other", "avx2", OPF_ISA_AVX2); /* another family's pick keeps its ISA */
    opf_log_note_pick("fam", "avx2", OPF_ISA_AVX2);
    opf_variant_fallback(&both, &fam_ref, "stride-0 gradient");
    opf_variant_fallback(&both, &fam_ref, "stride-0 gradient"); /* every row block: named once */
    int isa = opf_log_take_picks(t0, buf, sizeof buf);
    CHECK(isa == OPF_ISA_AVX2 && strcmp(buf, "other:avx2,fam:avx2->ref (stride-0 gradient)") == 0,
          "a fallback beside another family's pick: isa %d, '%s'", isa, buf);
    t0 = opf_now_us();
    opf_log_note_pick("fam", "avx2", OPF_ISA_AVX2);
    opf_variant_fallback(&both, &fam_ref, "float64");
    isa = opf_log_take_picks(t0, buf, sizeof buf);
    CHECK(isa == OPF_ISA_REF && strcmp(buf, "fam:avx2->ref (float64)") == 0,
          "the ISA of a call that fell back is the one that ran: isa %d, '%s'", isa, buf);
    t0 = opf_now_us();
    opf_variant_or_ref(&both, &fam_ref, "float64"); /* the reference picked: nothing fell back */
    CHECK(opf_log_take_picks(t0, buf, sizeof buf) == -1 && buf[0] == 0, "the reference fell back to itself: %s", buf);
    /* no pick noted (a table chosen with opf_variant_best): the pick named is the current ISA's best */
    t0 = opf_now_us();
    opf_variant_fallback(&both, &fam_ref, "why");
    opf_log_take_picks(t0, buf, sizeof buf);
    const char *want = opf_isa_current() >= OPF_ISA_AVX2 ? "fam:avx2->ref (why)" : "fam:ref->ref (why)";
    CHECK(strcmp(buf, want) == 0, "a fallback without a pick: '%s', want '%s'", buf, want);
    /* from workers: four chunks on four threads, three of them not the caller */
    const char *threads = getenv("OPFORGE_NUM_THREADS");
    char saved[32] = "";
    if (threads) snprintf(saved, sizeof saved, "%s", threads);
    setenv("OPFORGE_NUM_THREADS", "4", 1);
    t0 = opf_now_us();
    opf_log_note_pick("fam", "avx2", OPF_ISA_AVX2);
    opf_parallel_for(0, 1000, 250, fall_back_off_the_caller, (void *)&both);
    isa = opf_log_take_picks(t0, buf, sizeof buf);
    CHECK(isa == OPF_ISA_REF && strcmp(buf, "fam:avx2->ref (in a worker)") == 0,
          "a fallback noted by workers of opf_parallel_for: isa %d, '%s'", isa, buf);
    if (threads)
        setenv("OPFORGE_NUM_THREADS", saved, 1);
    else
        unsetenv("OPFORGE_NUM_THREADS");
    opf_log_set_level("warning", err, sizeof err);
}

int main(void) {
    test_isa();
    test_variant_picks_for_the_log();
    test_variant_fallbacks_for_the_log();
    test_nd();
    test_half();
    test_parallel();
    printf("cpu: %s, best ISA %s\n", opf_cpu()->model, opf_isa_name(opf_isa_best()));
    return check_report("test_runtime");
}
