/* Logging: one global level, lines to stderr or OPFORGE_LOG_FILE. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "opforge/runtime.h"

int opf_log_level_value = OPF_LOG_WARNING;
static FILE *log_file; /* NULL: stderr */

/* Guards log_file: ops log from any thread (torch's intra-op pool included)
 * while another may switch the file, and a FILE must not be closed under a
 * writer. Held across fork so that the child inherits it unlocked. */
static pthread_mutex_t sink_lock = PTHREAD_MUTEX_INITIALIZER;
/* Guards the records of kernels run (below), likewise held across fork. */
static pthread_mutex_t record_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t sink_once = PTHREAD_ONCE_INIT;

static void sink_acquire(void) { pthread_mutex_lock(&sink_lock); }
static void sink_release(void) { pthread_mutex_unlock(&sink_lock); }
static void fork_acquire(void) {
    sink_acquire();
    pthread_mutex_lock(&record_lock);
}
static void fork_release(void) {
    pthread_mutex_unlock(&record_lock);
    sink_release();
}
static void sink_register_fork(void) { pthread_atfork(fork_acquire, fork_release, fork_release); }

static void sink_enter(void) {
    pthread_once(&sink_once, sink_register_fork);
    sink_acquire();
}

static const char *const level_names[] = {"error", "warning", "info", "debug"};

int opf_log_set_level(const char *name, char *err, size_t errlen) {
    for (int i = 0; i <= OPF_LOG_DEBUG; i++) {
        if (strcasecmp(name, level_names[i]) == 0) {
            opf_log_level_value = i;
            return 0;
        }
    }
    snprintf(err, errlen, "OPFORGE_LOG_LEVEL=%s is not a known level; expected one of error, warning, info, debug",
             name);
    return -1;
}

int opf_log_set_file(const char *path, const char *source, char *err, size_t errlen) {
    FILE *f = NULL;
    if (path && path[0]) {
        f = fopen(path, "a");
        if (!f) {
            char reason[128];
            strerror_r(errno, reason, sizeof reason);
            snprintf(err, errlen, "%s: cannot open '%s' for appending: %s", source, path, reason);
            return -1;
        }
        setvbuf(f, NULL, _IOLBF, 0);
    }
    sink_enter();
    FILE *old = log_file;
    log_file = f;
    sink_release();
    if (old) fclose(old); /* no writer can hold it now: each takes the lock to find the file */
    return 0;
}

void opf_log(opf_log_level level, const char *fmt, ...) {
    if (!opf_log_enabled(level)) return;
    char line[1024];
    int n = snprintf(line, sizeof line, "[opforge %s] ", level_names[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    sink_enter();
    FILE *out = log_file ? log_file : stderr;
    fprintf(out, "%s\n", line);
    fflush(out);
    sink_release();
}

double opf_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

/* The kernels of a call, for its log line: a few per call (linear: GEMM and activation; a fallback), so a
 * small ring; older entries are overwritten. A pick has ran == NULL; a fallback names the variant that ran
 * instead of the one picked, and why. */
#define OPF_MAX_PICKS 8
struct opf_log_record {
    struct {
        const char *family, *variant, *ran;
        char why[48];
        opf_isa isa; /* of the code that ran */
        double t_us;
    } e[OPF_MAX_PICKS];
    int n, next; /* entries in use (at most OPF_MAX_PICKS); the slot to write */
};

/* Each thread notes into its own record, or, while it runs a chunk of another thread's
 * opf_parallel_for, into that thread's (opf_log_record_use): a record may then have several writers,
 * so notes and takes hold record_lock (at info level only, a few times per call). */
static _Thread_local opf_log_record own;
static _Thread_local opf_log_record *in_use;

opf_log_record *opf_log_record_current(void) { return in_use ? in_use : &own; }

opf_log_record *opf_log_record_use(opf_log_record *r) {
    opf_log_record *before = opf_log_record_current();
    in_use = r == &own ? NULL : r;
    return before;
}

static void record_enter(void) {
    pthread_once(&sink_once, sink_register_fork);
    pthread_mutex_lock(&record_lock);
}

static int same(const char *a, const char *b) { return a == b || (a && b && strcmp(a, b) == 0); }

/* The entry of r for (family, variant, ran, why), found or made, its time now. Under record_lock. */
static void note(opf_log_record *r, const char *family, const char *variant, const char *ran, const char *why,
                 opf_isa isa) {
    int slot = -1;
    for (int i = 0; i < r->n && slot < 0; i++) /* the same table again (every row block): once */
        if (same(r->e[i].family, family) && same(r->e[i].variant, variant) && same(r->e[i].ran, ran) &&
            (!ran || strncmp(r->e[i].why, why, sizeof r->e[i].why - 1) == 0))
            slot = i;
    if (slot < 0) {
        slot = r->next;
        r->next = (r->next + 1) % OPF_MAX_PICKS;
        if (r->n < OPF_MAX_PICKS) r->n++;
        r->e[slot].family = family;
        r->e[slot].variant = variant;
        r->e[slot].ran = ran;
        snprintf(r->e[slot].why, sizeof r->e[slot].why, "%s", ran ? why : "");
        r->e[slot].isa = isa;
    }
    r->e[slot].t_us = opf_now_us();
}

void opf_log_note_pick(const char *family, const char *variant, opf_isa isa) {
    record_enter();
    note(opf_log_record_current(), family, variant, NULL, NULL, isa);
    pthread_mutex_unlock(&record_lock);
}

void opf_log_note_fallback(const char *family, const char *picked, const char *ran, opf_isa isa, const char *why) {
    record_enter();
    opf_log_record *r = opf_log_record_current();
    double latest = -1;
    for (int i = 0; i < r->n; i++) /* the variant the call picked from the family: its latest pick */
        if (!r->e[i].ran && same(r->e[i].family, family) && r->e[i].t_us > latest)
            latest = r->e[i].t_us, picked = r->e[i].variant;
    note(r, family, picked, ran ? ran : "?", why ? why : "", isa);
    pthread_mutex_unlock(&record_lock);
}

/* Entry i is a pick that fell back in this call: its fallbacks name it and count instead. */
static int fell_back(const opf_log_record *r, int i, double t0_us) {
    for (int j = 0; j < r->n; j++)
        if (r->e[j].ran && r->e[j].t_us >= t0_us && same(r->e[j].family, r->e[i].family) &&
            same(r->e[j].variant, r->e[i].variant))
            return 1;
    return 0;
}

int opf_log_take_picks(double t0_us, char *buf, size_t len) {
    int best = -1;
    size_t used = 0;
    if (len) buf[0] = '\0';
    record_enter();
    opf_log_record *r = opf_log_record_current();
    for (int i = 0; i < r->n; i++) {
        /* an earlier call's, or one that logged nothing; a pick that fell back is named by its fallback */
        if (r->e[i].t_us < t0_us || (!r->e[i].ran && fell_back(r, i, t0_us))) continue;
        const char *family = r->e[i].family ? r->e[i].family : "?", *variant = r->e[i].variant ? r->e[i].variant : "?";
        if (used < len && r->e[i].ran)
            used += (size_t)snprintf(buf + used, len - used, "%s%s:%s->%s (%s)", used ? "," : "", family, variant,
                                     r->e[i].ran, r->e[i].why);
        else if (used < len)
            used += (size_t)snprintf(buf + used, len - used, "%s%s:%s", used ? "," : "", family, variant);
        if ((int)r->e[i].isa > best) best = (int)r->e[i].isa;
    }
    r->n = r->next = 0;
    pthread_mutex_unlock(&record_lock);
    return best;
}
