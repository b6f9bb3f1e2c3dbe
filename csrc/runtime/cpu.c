/* CPU feature detection (cpuid + XCR0), the process-wide ISA choice and the
 * choice of a kernel family's variant for it. */
#define _DEFAULT_SOURCE /* syscall */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "opforge/runtime.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static void detect(opf_cpu_features *f) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    const unsigned base_family = (a >> 8) & 0xf, base_model = (a >> 4) & 0xf;
    f->family = (int)(base_family + (base_family == 0xf ? (a >> 20) & 0xff : 0));
    f->model_number = (int)(base_model + (base_family == 0x6 || base_family == 0xf ? ((a >> 16) & 0xf) << 4 : 0));
    f->stepping = (int)(a & 0xf);
    int osxsave = (c >> 27) & 1;
    f->fma = (c >> 12) & 1;
    f->f16c = (c >> 29) & 1;
    if (osxsave) {
        uint64_t xcr0 = xgetbv0();
        f->os_avx = (xcr0 & 0x6) == 0x6;         /* XMM and YMM state */
        f->os_avx512 = (xcr0 & 0xe6) == 0xe6;    /* + opmask, ZMM_Hi256, Hi16_ZMM */
        f->os_amx = (xcr0 & 0x60000) == 0x60000; /* XTILECFG, XTILEDATA */
    }
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        f->avx2 = (b >> 5) & 1;
        f->avx512f = (b >> 16) & 1;
        f->avx512dq = (b >> 17) & 1;
        f->avx512bw = (b >> 30) & 1;
        f->avx512vl = (b >> 31) & 1;
        f->amx_bf16 = (d >> 22) & 1;
        f->amx_tile = (d >> 24) & 1;
        __cpuid_count(7, 1, a, b, c, d);
        f->avx512bf16 = (a >> 5) & 1;
    }
    if (__get_cpuid_max(0x80000000, NULL) >= 0x80000004) {
        unsigned *m = (unsigned *)f->model;
        for (unsigned leaf = 0; leaf < 3; leaf++)
            __get_cpuid(0x80000002 + leaf, &m[4 * leaf], &m[4 * leaf + 1], &m[4 * leaf + 2], &m[4 * leaf + 3]);
        f->model[48] = '\0';
    }
}

/* Linux hands out the 8 KiB tile state per process on request (5.16 and
 * later); without it the first tile instruction faults. Asked once. */
static int amx_permitted(void) {
    static int state = -1;
    if (state < 0) {
#if defined(__linux__) && defined(SYS_arch_prctl)
        enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
        state = 0;
#endif
    }
    return state;
}
#else
static void detect(opf_cpu_features *f) { (void)f; }
static int amx_permitted(void) { return 0; }
#endif

static opf_cpu_features features;
static int features_ready;
static opf_isa current_isa = OPF_ISA_COUNT; /* COUNT: not chosen yet */

const opf_cpu_features *opf_cpu(void) {
    if (!features_ready) {
        memset(&features, 0, sizeof features);
        detect(&features);
        /* trim the padding some vendors put around the brand string */
        char *s = features.model;
        while (*s == ' ') s++;
        memmove(features.model, s, strlen(s) + 1);
        for (size_t n = strlen(features.model); n && features.model[n - 1] == ' '; n--) features.model[n - 1] = '\0';
        features_ready = 1;
    }
    return &features;
}

static const char *const isa_names[OPF_ISA_COUNT] = {"ref", "avx2", "avx512", "avx512_bf16", "amx"};

const char *opf_isa_name(opf_isa isa) { return (unsigned)isa < OPF_ISA_COUNT ? isa_names[isa] : "unknown"; }

static int isa_supported(opf_isa isa) {
    const opf_cpu_features *f = opf_cpu();
#ifdef OPF_EMULATE_AVX512
    /* the emulated AVX-512 test build (tests/emu): its AVX-512 variants run on AVX2 */
    if (isa == OPF_ISA_AVX512 || isa == OPF_ISA_AVX512_BF16) return isa_supported(OPF_ISA_AVX2);
#endif
    switch (isa) {
    case OPF_ISA_REF: return 1;
    case OPF_ISA_AVX2: return f->os_avx && f->avx2 && f->fma && f->f16c;
    case OPF_ISA_AVX512:
        return isa_supported(OPF_ISA_AVX2) && f->os_avx512 && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq;
    case OPF_ISA_AVX512_BF16: return isa_supported(OPF_ISA_AVX512) && f->avx512bf16;
    case OPF_ISA_AMX:
        return isa_supported(OPF_ISA_AVX512_BF16) && f->amx_tile && f->amx_bf16 && f->os_amx && amx_permitted();
    default: return 0;
    }
}

opf_isa opf_isa_best(void) {
    opf_isa best = OPF_ISA_REF;
    for (int i = 1; i < OPF_ISA_COUNT; i++)
        if (isa_supported((opf_isa)i)) best = (opf_isa)i;
    return best;
}

opf_isa opf_isa_current(void) {
    if (current_isa == OPF_ISA_COUNT) current_isa = opf_isa_best();
    return current_isa;
}

int opf_isa_set(const char *name, char *err, size_t errlen) {
    if (name == NULL || name[0] == '\0' || strcmp(name, "auto") == 0) {
        current_isa = opf_isa_best();
        return 0;
    }
    for (int i = 0; i < OPF_ISA_COUNT; i++) {
        if (strcmp(name, isa_names[i]) != 0) continue;
        if (!isa_supported((opf_isa)i)) {
            snprintf(err, errlen, "OPFORGE_ISA=%s is not supported by this CPU (%s); it supports up to '%s'", name,
                     opf_cpu()->model[0] ? opf_cpu()->model : "unknown model", isa_names[opf_isa_best()]);
            return -1;
        }
        current_isa = (opf_isa)i;
        return 0;
    }
    char names[128] = "auto";
    for (int i = 0; i < OPF_ISA_COUNT; i++) {
        size_t used = strlen(names);
        snprintf(names + used, sizeof names - used, ", %s", isa_names[i]);
    }
    snprintf(err, errlen, "OPFORGE_ISA=%s is not a known ISA; expected one of %s", name, names);
    return -1;
}

int opf_runtime_init(char *err, size_t errlen) {
    if (opf_isa_set(getenv("OPFORGE_ISA"), err, errlen)) return -1;
    const char *level = getenv("OPFORGE_LOG_LEVEL");
    if (level && level[0] && opf_log_set_level(level, err, errlen)) return -1;
    const char *file = getenv("OPFORGE_LOG_FILE");
    if (file && file[0] && opf_log_set_file(file, "the environment variable OPFORGE_LOG_FILE", err, errlen)) return -1;
    return 0;
}

const void *opf_variant_best(const opf_variants *vs, opf_isa isa) {
    const opf_variant *best = NULL;
    for (int i = 0; i < vs->count; i++) {
        const opf_variant *v = vs->tables[i];
        if (v && v->isa <= isa && (!best || v->isa >= best->isa)) best = v;
    }
    return best;
}

const void *opf_variant_pick(const opf_variants *vs, opf_isa isa) {
    const opf_variant *best = opf_variant_best(vs, isa);
    if (best && opf_log_enabled(OPF_LOG_INFO)) opf_log_note_pick(vs->family, best->name, best->isa);
    return best;
}

void opf_variant_fallback(const opf_variants *vs, const void *ran, const char *why) {
    if (!opf_log_enabled(OPF_LOG_INFO)) return;
    const opf_variant *r = ran, *picked = opf_variant_best(vs, opf_isa_current());
    opf_log_note_fallback(vs->family, picked ? picked->name : NULL, r ? r->name : NULL, r ? r->isa : OPF_ISA_REF, why);
}

const void *opf_variant_or_ref(const opf_variants *vs, const void *picked, const char *why) {
    if (!why || picked == vs->tables[0]) return picked;
    opf_variant_fallback(vs, vs->tables[0], why);
    return vs->tables[0];
}
