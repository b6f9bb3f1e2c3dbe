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
static pthread_once_t sink_once = PTHREAD_ONCE_INIT;

static void sink_acquire(void) { pthread_mutex_lock(&sink_lock); }
static void sink_release(void) { pthread_mutex_unlock(&sink_lock); }
static void sink_register_fork(void) { pthread_atfork(sink_acquire, sink_release, sink_release); }

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

/* The picks of this thread's current call: a few per call (linear: GEMM and
 * activation), so a small ring; older entries are overwritten. */
#define OPF_MAX_PICKS 8
static _Thread_local struct {
    const char *family, *variant;
    opf_isa isa;
    double t_us;
} picks[OPF_MAX_PICKS];
static _Thread_local int npicks, next_pick; /* entries in use (at most OPF_MAX_PICKS); the slot to write */

void opf_log_note_pick(const char *family, const char *variant, opf_isa isa) {
    double now = opf_now_us();
    for (int i = 0; i < npicks; i++) /* the same table again (every row block): once */
        if (picks[i].family == family && picks[i].variant == variant) {
            picks[i].t_us = now;
            return;
        }
    int slot = next_pick;
    next_pick = (next_pick + 1) % OPF_MAX_PICKS;
    if (npicks < OPF_MAX_PICKS) npicks++;
    picks[slot].family = family;
    picks[slot].variant = variant;
    picks[slot].isa = isa;
    picks[slot].t_us = now;
}

int opf_log_take_picks(double t0_us, char *buf, size_t len) {
    int best = -1;
    size_t used = 0;
    if (len) buf[0] = '\0';
    for (int i = 0; i < npicks; i++) {
        if (picks[i].t_us < t0_us) continue; /* an earlier call's, or one that logged nothing */
        if (used < len)
            used +=
                (size_t)snprintf(buf + used, len - used, "%s%s:%s", used ? "," : "",
                                 picks[i].family ? picks[i].family : "?", picks[i].variant ? picks[i].variant : "?");
        if ((int)picks[i].isa > best) best = (int)picks[i].isa;
    }
    npicks = next_pick = 0;
    return best;
}
