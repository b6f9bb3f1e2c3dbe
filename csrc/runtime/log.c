/* Logging: one global level, lines to stderr or OPFORGE_LOG_FILE. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "opforge/runtime.h"

int opf_log_level_value = OPF_LOG_WARNING;
static FILE *log_file; /* NULL: stderr */

static const char *const level_names[] = {"error", "warning", "info", "debug"};

int opf_log_set_level(const char *name, char *err, size_t errlen) {
    for (int i = 0; i <= OPF_LOG_DEBUG; i++) {
        if (strcasecmp(name, level_names[i]) == 0) {
            opf_log_level_value = i;
            return 0;
        }
    }
    snprintf(err, errlen,
             "OPFORGE_LOG_LEVEL=%s is not a known level; expected one of error, warning, info, debug",
             name);
    return -1;
}

int opf_log_set_file(const char *path, char *err, size_t errlen) {
    FILE *f = NULL;
    if (path && path[0]) {
        f = fopen(path, "a");
        if (!f) {
            snprintf(err, errlen, "OPFORGE_LOG_FILE=%s cannot be opened for appending", path);
            return -1;
        }
        setvbuf(f, NULL, _IOLBF, 0);
    }
    if (log_file) fclose(log_file);
    log_file = f;
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
    FILE *out = log_file ? log_file : stderr;
    fprintf(out, "%s\n", line); /* one write per line keeps threads' lines whole */
    fflush(out);
}

double opf_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}
