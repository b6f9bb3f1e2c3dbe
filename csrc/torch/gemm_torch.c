/*
 * The torch GEMM provider (gemm.h): the products of linear, matmul and
 * linear_cross_entropy (forward and backward) run on torch's own CPU GEMM
 * (aten::mm / aten::addmm: MKL or oneDNN, AMX tiles for bfloat16) where that
 * is the faster one on this machine, and on opforge's kernels elsewhere. The
 * epilogue stays opforge's (gemm_finish), and so does every fusion around the
 * GEMM: the bias, activation and GLU epilogues, the cross-entropy's online
 * log-sum-exp and blockwise gradient run over whichever GEMM made the block.
 *
 * Mode (OPFORGE_GEMM, set_gemm()): "own" (opforge's kernels only), "torch"
 * (torch's GEMM for every product it takes), "auto" (default): per class of
 * product -- the kernel table (ISA), the operand and result types, whether an
 * epilogue follows, the thread count, M, N and K rounded up to powers of two,
 * and the operands' layouts -- the first SAMPLES x 2 products of the class
 * (up to MORE_SAMPLES x 2 while the two are within 8% of the line between
 * them) run on the two GEMMs in turn, each timed as it runs (the whole call,
 * epilogue included, per multiply-add), and the faster one (best sample
 * against best sample; a product with an epilogue stays on opforge's kernel
 * within 3%, a plain product needs opforge's kernel 5% ahead: a near tie
 * goes to torch's, the GEMM eager runs) runs every product of the class from
 * then on; a class is re-checked on later calls, whichever GEMM it went to
 * (RECHECK_FIRST). The measuring costs
 * no extra work: the products are the caller's own, on their own operands and
 * outputs, at their own sizes; only those few calls may run the slower GEMM.
 * Choices are kept for the process and, where the Python layer names a file
 * (keyed by CPU model, torch version and build of opforge's library), on
 * disk, so a later process measures nothing it has measured before. A class
 * settled on torch's GEMM is claimed (provider_claims): linear's and
 * matmul's plans then run its products whole, with no opforge workspace (a
 * re-check's sample of opforge's kernel on such a call brings its own).
 * (A first version timed both GEMMs on a corner of the first product into
 * scratch outputs: the corner's ratio
 * was not the whole product's -- at 2048^3 it chose torch's GEMM where
 * opforge's is 1.12x faster.)
 *
 * What torch's GEMM takes: float32 and bfloat16 operands, one of them float32
 * and the other bfloat16 too (the float32 one is rounded to bfloat16 into a
 * scratch copy, as the pair kernels round it), each with a unit stride in one
 * dimension, and products of at least MIN_WORK multiply-adds. float16 and
 * float64 stay on opforge's kernels. A bfloat16 product comes back from
 * torch rounded to bfloat16 (aten::mm has no float32-result form on CPU), so
 * an epilogue after it (bias, activation) rounds twice, as eager's addmm then
 * activation does.
 *
 * Determinism: a product's provider depends on its class, and the thread
 * count is part of the class; OPFORGE_GEMM=own gives results that are
 * bitwise the same at every thread count.
 *
 * Length: past the usual 650 lines since the re-checks of classes on torch's
 * GEMM. The file holds two jobs: the choice table every provider shares
 * (opf_provider_begin / end / decided / routed, the re-checks, the cache
 * file; attention.c uses it too) and the GEMM's own part (torch's product,
 * class keys, claims, own_sample). The table's half would move to a
 * provider.c of its own behind provider.h, which already declares it; not
 * done in the same change as the re-checks.
 */
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../kernels/gemm.h"
#include "opforge/op.h"
#include "provider.h"

enum { MODE_OWN = OPF_PROVIDER_OWN, MODE_TORCH = OPF_PROVIDER_TORCH, MODE_AUTO = OPF_PROVIDER_AUTO };
static const char *const mode_names[] = {"own", "torch", "auto"};
static int mode = MODE_AUTO; /* atomic */

enum { MIN_WORK = 1 << 18 }; /* 64^3 multiply-adds */
/* timed calls per GEMM and class; the best counts (the first one warms up). Where the best samples are
 * within CLOSE of each other after SAMPLES, a noisy machine could pick either: each side is sampled up to
 * MORE_SAMPLES times (the extra calls cost at most that gap each). */
enum { SAMPLES = 3, MORE_SAMPLES = 8 };
#define CLOSE 0.92
/* A decided class is sampled again on torch's kernel, then on opforge's (RECHECK_SIDE calls each), from
 * its calls number RECHECK_FIRST, twice that, ... up to RECHECK_LAST in a process (7 re-checks at most),
 * and the two best samples decide it again: the first calls' samples run among cold caches and fresh pages, and
 * a rate a busy moment cut short would otherwise keep a class on the slower kernel for good -- and in
 * the cache file, for every later process (on Zen 4 a 1 x 512 x 512 float32 product went to torch's
 * GEMM at 9.2 against 12.8 GFLOP/s in a busy process, where opforge's runs 25-51 against 11-20).
 * A class on torch's GEMM counts the calls it claims (run with no workspace: the sample of opforge's
 * kernel brings its own) and the calls the Python layer sent to torch's function in its stead
 * (opf_provider_routed); it is unsettled during a re-check, which makes the Python layer send its next
 * calls to the op for the samples. */
enum { RECHECK_FIRST = 32, RECHECK_LAST = 2048 };
/* A re-check's samples of each kernel, the calls in a row: the first of a kernel that has not run for a
 * while wakes its threads (opforge's pool, torch's OpenMP team), which for a small product is most of
 * its time (on Zen 4, 1 x 512 x 512 float32 amid torch's calls: 6-13 GFLOP/s on opforge's kernel
 * alone, 26-30 on the second call; the best sample counts) */
enum { RECHECK_SIDE = 2 };
/* a class in a re-check that needs the op's calls (one on torch's GEMM, whose calls the Python layer routes)
 * is unsettled until its samples are taken: at most this many questions (opf_provider_decided, claims'
 * settled) then find it so, after which the re-check is given up (samples that never come: a weight
 * gradient's, with no backward; each new key of the class would otherwise be sent to the op) */
enum { RECHECK_WAITS = 64 };
/* the most floats a claimed call's sample of opforge's kernel allocates (its workspace, and float32 partial
 * sums where the call writes 16-bit results only): past it the call runs on torch's GEMM unsampled (the
 * re-check then ends on torch's samples alone, and the class stays) */
enum { OWN_SAMPLE_MAX_FLOATS = 1 << 24 };
/* own's best rate over torch's that keeps a class on opforge's kernel (opf_provider_end) */
#define OWN_FUSED_MARGIN 0.97
#define OWN_PLAIN_MARGIN 1.05

typedef struct choice {
    char key[160];
    int decided, torch;          /* torch: torch's kernel runs the class */
    int n_own, n_torch;          /* the samples taken (of a class still being measured) */
    double own_rate, torch_rate; /* the best samples, in multiply-adds per nanosecond */
    int here;                    /* measured in this process (0: read from the cache file) */
    int calls;                   /* calls since it was decided, in this process (the re-checks' count) */
    int recheck;                 /* a re-check's samples still to take: torch's while above RECHECK_SIDE,
                                    then own's */
    unsigned reported;           /* the last report of routed calls counted (opf_provider_routed_calls) */
    int waits;                   /* questions that found it unsettled in this re-check (RECHECK_WAITS) */
} choice;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static choice *choices;
static int nchoices, capacity;
static char cache_file[1024];
static int cache_read;
/* this thread's report of calls the Python layer routed to torch's function (opf_provider_routed_calls):
 * their count and the report's number (0: none) */
static _Thread_local int64_t report_calls;
static _Thread_local unsigned report_id;
static unsigned reports; /* atomic */

/* ---- torch's product ------------------------------------------------------- */

AtenTensorHandle opf_provider_wrap(const void *data, int64_t ndim, const int64_t *sizes, const int64_t *strides,
                                   opf_dtype dt) {
    AtenTensorHandle t = NULL;
    if (aoti_torch_create_tensor_from_blob((void *)data, ndim, sizes, strides, 0,
                                           dt == OPF_F32 ? aoti_torch_dtype_float32() : aoti_torch_dtype_bfloat16(),
                                           aoti_torch_device_type_cpu(), 0, &t) != OPF_AOTI_SUCCESS)
        return NULL;
    return t;
}

void opf_provider_release(AtenTensorHandle *h, int n) {
    for (int i = 0; i < n; i++)
        if (h[i]) aoti_torch_delete_tensor_object(h[i]), h[i] = NULL;
}

static AtenTensorHandle wrap(const void *data, int64_t rows, int64_t cols, int64_t rs, int64_t cs, opf_dtype dt) {
    const int64_t sizes[2] = {rows, cols}, strides[2] = {rs, cs};
    return opf_provider_wrap(data, 2, sizes, strides, dt);
}

/* A float32 operand rounded to bfloat16, in its own layout (the unit stride kept) */
typedef struct round_job {
    const convert_kernels *cvt;
    const float *src;
    uint16_t *dst;
    int64_t len, stride; /* lines of len contiguous elements, stride apart in src */
} round_job;

static void round_lines(int64_t l0, int64_t l1, void *ctx) {
    const round_job *j = ctx;
    for (int64_t l = l0; l < l1; l++) j->cvt->from_f32(j->dst + l * j->len, j->src + l * j->stride, OPF_BF16, j->len);
}

static void *alloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* rows x cols of strides (rs, cs), one of them 1: a bfloat16 copy with strides (*rs16, *cs16) */
static uint16_t *rounded(const gemm_kernels *kern, const float *src, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                         int64_t *rs16, int64_t *cs16) {
    uint16_t *dst = alloc((size_t)(rows * cols) * sizeof(uint16_t));
    if (!dst) return NULL;
    const int by_rows = cs == 1;
    round_job j = {.cvt = kern->cvt, .src = src, .dst = dst, .len = by_rows ? cols : rows, .stride = by_rows ? rs : cs};
    opf_parallel_for(0, by_rows ? rows : cols, j.len >= 4096 ? 1 : 4096 / j.len, round_lines, &j);
    *rs16 = by_rows ? cols : 1;
    *cs16 = by_rows ? 1 : rows;
    return dst;
}

/* The call's product on torch's GEMM, finished by gemm_finish. 0, or -1 (nothing usable written: the
 * caller runs opforge's kernels, which overwrite whatever was). */
static int run_torch(const gemm_call *k) {
    const gemm_plan *plan = k->plan;
    const gemm_epilogue *ep = k->ep;
    const int64_t m = plan->m, n = plan->n, kk = plan->k;
    opf_dtype dt = plan->ta == OPF_BF16 || plan->tb == OPF_BF16 ? OPF_BF16 : OPF_F32;
    const void *a = k->a, *b = k->b;
    int64_t rsa = k->rsa, csa = k->csa, rsb = k->rsb, csb = k->csb;
    uint16_t *a16 = NULL, *b16 = NULL, *bias16 = NULL;
    void *prod = NULL;
    AtenTensorHandle ta = NULL, tb = NULL, tout = NULL, tbias = NULL;
    int rc = -1;
    if (plan->ta != dt && !(a = a16 = rounded(plan->kern, a, m, kk, rsa, csa, &rsa, &csa))) goto done;
    if (plan->tb != dt && !(b = b16 = rounded(plan->kern, b, kk, n, rsb, csb, &rsb, &csb))) goto done;
    if (!(ta = wrap(a, m, kk, rsa, csa, dt)) || !(tb = wrap(b, kk, n, rsb, csb, dt))) goto done;
    /* Straight into the result: C (beta C included), or the bfloat16 result (beta is 0); else into
     * scratch, finished into C (beta C added there) or the 16-bit result. The bias goes into the
     * product wherever beta C does not (addmm's self), added before the product's one rounding as
     * eager's addmm adds it: a bfloat16 product rounded before the bias was added could change sign,
     * and a ReLU's mask with it. */
    const int into_c = dt == OPF_F32 && !ep->out16, into_out16 = dt == OPF_BF16 && ep->out16 && ep->out_dt == OPF_BF16;
    const int beta_c = into_c && ep->beta != 0.0f;
    gemm_epilogue rest = *ep;
    const double alpha = ep->alpha ? (double)*ep->alpha : 1.0; /* in torch's product, not the finish */
    rest.alpha = NULL;
    void *out = into_c       ? (void *)k->c
                : into_out16 ? ep->out16
                             : (prod = alloc((size_t)(m * n) * (dt == OPF_F32 ? 4 : 2)));
    const int64_t rs_out = into_c || into_out16 ? k->rsc : n;
    if (!out || !(tout = wrap(out, m, n, rs_out, 1, dt))) goto done;
    AOTITorchError e;
    if (beta_c) {
        e = aoti_torch_cpu_addmm_out(tout, tout, ta, tb, ep->beta, alpha);
    } else if (ep->bias_kind != GEMM_BIAS_NONE) {
        const int64_t len = ep->bias_kind == GEMM_BIAS_ROW ? n : m;
        const void *bias = ep->bias;
        if (dt == OPF_BF16) { /* the op's bfloat16 bias, which its float32 copy holds exactly */
            if (!(bias16 = alloc((size_t)len * 2))) goto done;
            plan->kern->cvt->from_f32(bias16, ep->bias, OPF_BF16, len);
            bias = bias16;
        }
        if (!(tbias = ep->bias_kind == GEMM_BIAS_ROW ? wrap(bias, m, n, 0, 1, dt) : wrap(bias, m, n, 1, 0, dt)))
            goto done;
        e = aoti_torch_cpu_addmm_out(tout, tbias, ta, tb, 1.0, alpha);
        rest.bias_kind = GEMM_BIAS_NONE;
        rest.bias = NULL;
    } else if (alpha != 1.0) { /* beta 0: addmm does not read self */
        e = aoti_torch_cpu_addmm_out(tout, tout, ta, tb, 0.0, alpha);
    } else {
        e = aoti_torch_cpu_mm_out(tout, ta, tb);
    }
    if (e != OPF_AOTI_SUCCESS) goto done;
    if (prod)
        gemm_finish(plan, prod, dt, n, 1, k->c, k->rsc, &rest);
    else if (gemm_epilogue_needed(&rest))
        gemm_finish(plan, out, dt, k->rsc, 0, k->c, k->rsc, &rest);
    rc = 0;
done:
    AtenTensorHandle handles[4] = {ta, tb, tout, tbias};
    opf_provider_release(handles, 4);
    free(bias16);
    free(a16);
    free(b16);
    free(prod);
    return rc;
}

/* ---- classes ---------------------------------------------------------------- */

/* the operand types, layouts and size torch's GEMM takes (what it writes to is the call's: claims asks
 * before there is any) */
static int takes_class(const gemm_call *k) {
    const gemm_plan *p = k->plan;
    const int types = (p->ta == OPF_F32 || p->ta == OPF_BF16) && (p->tb == OPF_F32 || p->tb == OPF_BF16);
    const int unit = (k->csa == 1 || k->rsa == 1) && (k->csb == 1 || k->rsb == 1);
    return types && unit && (double)p->m * (double)p->n * (double)p->k >= MIN_WORK;
}

static int takes(const gemm_call *k) { return takes_class(k) && (k->c || k->ep->out16); }

static char dt_char(opf_dtype dt) { return dt == OPF_F32 ? 'f' : dt == OPF_BF16 ? 'b' : dt == OPF_F16 ? 'h' : 'd'; }

static char layout(int64_t rs, int64_t cs) { return cs == 1 ? 'n' : rs == 1 ? 't' : 'g'; }

/* text at `at`, up to end: past its end */
static char *put_text(char *at, char *end, const char *text) {
    while (*text && at < end) *at++ = *text++;
    return at;
}

static char *put_number(char *at, char *end, int64_t v) {
    char digits[24];
    int n = 0;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do digits[n++] = (char)('0' + u % 10);
    while ((u /= 10) && n < 22);
    if (v < 0) digits[n++] = '-';
    while (n && at < end) *at++ = digits[--n];
    return at;
}

/* "avx512_12x32 fb>f e t2 m11 n13 k9 nt": table, operand types > result type, epilogue, threads,
 * log2 of M (of the products the claim was asked about, for a claimed call that merged them), N, K
 * rounded up, layouts of A and B (n: rows contiguous, t: columns) */
static void class_key(const gemm_call *k, char *key, size_t len) {
    const gemm_plan *p = k->plan;
    const int64_t m = k->claimed && k->class_m > 0 ? k->class_m : p->m;
    /* written by hand: this runs on every product's call in auto mode (up to three times), and snprintf's
     * eleven fields took ~0.5 us of a 20 us call */
    char *at = key, *const end = key + len - 1;
    at = put_text(at, end, p->kern->name);
    const char chars[] = {' ',
                          dt_char(p->ta),
                          dt_char(p->tb),
                          '>',
                          k->ep->out16 ? dt_char(k->ep->out_dt) : 'f',
                          ' ',
                          gemm_epilogue_needed(k->ep) ? 'e' : '-',
                          ' ',
                          't',
                          '\0'};
    at = put_text(at, end, chars);
    at = put_number(at, end, p->threads);
    at = put_text(at, end, " m");
    at = put_number(at, end, opf_provider_log2_up(m));
    at = put_text(at, end, " n");
    at = put_number(at, end, opf_provider_log2_up(p->n));
    at = put_text(at, end, " k");
    at = put_number(at, end, opf_provider_log2_up(p->k));
    const char layouts[] = {' ', layout(k->rsa, k->csa), layout(k->rsb, k->csb), '\0'};
    at = put_text(at, end, layouts);
    *at = '\0';
}

/* under lock */
static choice *find(const char *key) {
    for (int i = 0; i < nchoices; i++)
        if (strcmp(choices[i].key, key) == 0) return &choices[i];
    return NULL;
}

/* under lock: the class's entry, made (undecided, no samples) when new; NULL when out of memory */
static choice *entry(const char *key) {
    choice *c = find(key);
    if (c) return c;
    if (nchoices == capacity) {
        int cap = capacity ? 2 * capacity : 64;
        choice *grown = realloc(choices, (size_t)cap * sizeof *grown);
        if (!grown) return NULL;
        choices = grown;
        capacity = cap;
    }
    c = &choices[nchoices++];
    memset(c, 0, sizeof *c);
    size_t len = 0; /* keys are ours, and shorter; a longer one is cut */
    while (len < sizeof c->key - 1 && key[len]) len++;
    memcpy(c->key, key, len);
    return c;
}

/* under lock: the cache file's lines "key<TAB>own|torch<TAB>own rate<TAB>torch rate" */
static void read_cache(void) {
    cache_read = 1;
    if (!cache_file[0]) return;
    FILE *f = fopen(cache_file, "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        char *tab1 = strchr(line, '\t'), *tab2 = tab1 ? strchr(tab1 + 1, '\t') : NULL;
        if (!tab2) continue;
        *tab1 = *tab2 = '\0';
        double own = 0, torch = 0;
        if (sscanf(tab2 + 1, "%lf\t%lf", &own, &torch) != 2) continue;
        const int on_torch = strcmp(tab1 + 1, "torch") == 0;
        choice *c = on_torch || strcmp(tab1 + 1, "own") == 0 ? entry(line) : NULL;
        if (!c) continue;
        c->decided = 1, c->torch = on_torch, c->own_rate = own, c->torch_rate = torch, c->here = 0;
    }
    fclose(f);
}

/* under lock: one line, appended in one write (several processes may share the file) */
static void save(const choice *c) {
    if (!cache_file[0]) return;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", cache_file);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) { /* its folder, and the folders above it */
        *slash = '\0';
        for (char *s = dir + 1; *s; s++)
            if (*s == '/') {
                *s = '\0';
                mkdir(dir, 0755);
                *s = '/';
            }
        mkdir(dir, 0755);
    }
    int fd = open(cache_file, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) {
        opf_log(OPF_LOG_WARNING, "provider: cannot write the provider cache %s", cache_file);
        return;
    }
    char line[512];
    int len = snprintf(line, sizeof line, "%s\t%s\t%.4g\t%.4g\n", c->key, c->torch ? "torch" : "own", c->own_rate,
                       c->torch_rate);
    if (write(fd, line, (size_t)len) != len) opf_log(OPF_LOG_WARNING, "provider: cannot write %s", cache_file);
    close(fd);
}

int opf_provider_mode(void) { return __atomic_load_n(&mode, __ATOMIC_RELAXED); }

/* under lock: counts `more` calls of a decided class; 1 where they reach a re-check (its call number
 * RECHECK_FIRST, twice that, ... RECHECK_LAST since the decision) */
static int recheck_due(choice *c, int64_t more) {
    if (c->calls > RECHECK_LAST || more <= 0) return 0;
    const int64_t from = c->calls, to = from + more;
    c->calls = to > RECHECK_LAST ? RECHECK_LAST + 1 : (int)to;
    for (int64_t at = RECHECK_FIRST; at <= RECHECK_LAST; at *= 2)
        if (from < at && at <= to) return 1;
    return 0;
}

/* under lock: counts calls of a class on torch's kernel that the Python layer routed to torch's own
 * function; at a re-check, the op's next calls take its samples (both kernels': the sides' best samples
 * are set against each other, and a side sampled more often would have more chances of a fast one) */
static void count_routed(choice *c, int64_t calls) {
    if (c && c->decided && c->torch && !c->recheck && recheck_due(c, calls)) {
        c->recheck = 2 * RECHECK_SIDE, c->waits = 0;
        opf_log(OPF_LOG_INFO, "provider: class '%s' re-checked at call %d: the op's next calls sample it", c->key,
                c->calls);
    }
}

/* under lock: whether a decided class's choice stands (not one on torch's kernel in a re-check: the Python
 * layer sends its calls to the op until the samples are taken, or RECHECK_WAITS questions gave it up) */
static int stands(choice *c) {
    if (!c->decided) return 0;
    if (!c->torch || c->recheck <= 0) return 1;
    if (++c->waits <= RECHECK_WAITS) return 0;
    c->recheck = 0;
    opf_log(OPF_LOG_INFO, "provider: class '%s': the re-check's samples did not come; it stays on torch's", c->key);
    return 1;
}

/* under lock: a decided class's call, counted; a re-check's sample where one is due (into turn: torch's
 * first, then own's) */
static void recheck_turn(choice *c, opf_provider_turn *turn) {
    if (!c->recheck && !recheck_due(c, 1)) return;
    if (!c->recheck) c->recheck = 2 * RECHECK_SIDE, c->waits = 0;
    turn->torch = c->recheck-- > RECHECK_SIDE;
    turn->measuring = 1;
    snprintf(turn->key, sizeof turn->key, "%s", c->key);
}

void opf_provider_routed(const char *key, int64_t calls) {
    if (calls <= 0 || opf_provider_mode() != OPF_PROVIDER_AUTO) return;
    pthread_mutex_lock(&lock);
    if (!cache_read) read_cache();
    count_routed(find(key), calls);
    pthread_mutex_unlock(&lock);
}

void opf_provider_routed_calls(int64_t calls) {
    unsigned id = 0;
    while (calls > 0 && !id) id = __atomic_add_fetch(&reports, 1, __ATOMIC_RELAXED); /* (0: none) */
    report_calls = calls > 0 ? calls : 0;
    report_id = id;
}

int opf_provider_begin(const char *key, opf_provider_turn *turn) {
    const int md = opf_provider_mode();
    turn->measuring = 0;
    turn->fused = 1; /* unless the caller says otherwise */
    turn->torch = md == OPF_PROVIDER_TORCH;
    if (md != OPF_PROVIDER_AUTO) return turn->torch;
    pthread_mutex_lock(&lock);
    if (!cache_read) read_cache();
    choice *c = entry(key);
    if (!c) { /* no memory for the table: opforge's kernels, unmeasured */
        turn->torch = 0;
    } else if (c->decided) {
        turn->torch = c->torch;
        recheck_turn(c, turn);
    } else { /* a sample of the side with fewer, opforge's first */
        turn->torch = c->n_torch < c->n_own;
        turn->measuring = 1;
        snprintf(turn->key, sizeof turn->key, "%s", key);
    }
    pthread_mutex_unlock(&lock);
    if (turn->measuring) turn->t0 = opf_now_us();
    return turn->torch;
}

void opf_provider_end(const opf_provider_turn *turn, double work, int failed) {
    if (!turn->measuring) return;
    const double rate = work / ((opf_now_us() - turn->t0) * 1e3 + 1.0); /* per nanosecond */
    pthread_mutex_lock(&lock);
    choice *c = find(turn->key);
    const int rechecked = c && c->decided; /* a re-check's sample (opf_provider_begin) */
    if (c && failed) { /* torch's kernel could not run it: opforge's, for good, and no more re-checks */
        c->here = rechecked && !c->torch ? c->here : 1;
        c->decided = 1, c->torch = 0;
        c->calls = RECHECK_LAST + 1, c->recheck = 0;
    } else if (c) { /* the side's best sample */
        *(turn->torch ? &c->n_torch : &c->n_own) += 1;
        double *best = turn->torch ? &c->torch_rate : &c->own_rate;
        if (rate > *best) *best = rate;
    }
    const int torch_now =
        c && c->torch_rate > c->own_rate / (turn->fused ? OWN_FUSED_MARGIN : OWN_PLAIN_MARGIN); /* by the best */
    if (rechecked && !failed && !turn->torch && !c->recheck && torch_now != c->torch) {         /* own's last sample */
        c->torch = torch_now, c->here = 1;
        save(c);
        opf_log(OPF_LOG_INFO, "provider: class '%s' re-checked at call %d: own %.1f, torch %.1f GFLOP/s: %s", c->key,
                c->calls, 2 * c->own_rate, 2 * c->torch_rate, c->torch ? "torch" : "own");
    } else if (c && !c->decided) {
        /* own's rate is set against torch's over the margin it must clear: within 3% behind where it
         * fuses an epilogue (a near tie stays with the kernel that saves a pass), 5% ahead for a plain
         * product (a near tie goes to torch's GEMM: on Zen 4 bf16 products measured within 3% on their
         * first calls ran 3-10% slower than torch's afterwards, and on the AMX Xeon a linear's bf16
         * weight gradient measured 4-12% ahead of torch's in 1 process of 5 ran 12% behind it in steady
         * state; the samples are a class's first calls, among cold caches and fresh pages). Near that
         * line more samples are taken. */
        const double own = c->own_rate / (turn->fused ? OWN_FUSED_MARGIN : OWN_PLAIN_MARGIN);
        const double lo = own < c->torch_rate ? own : c->torch_rate, hi = own < c->torch_rate ? c->torch_rate : own;
        const int enough = lo < CLOSE * hi ? SAMPLES : MORE_SAMPLES;
        if (!c->decided && c->n_own >= enough && c->n_torch >= enough) {
            c->decided = 1, c->here = 1;
            c->torch = c->torch_rate > own;
            save(c);
            opf_log(OPF_LOG_INFO, "provider: class '%s': own %.1f, torch %.1f GFLOP/s: %s", c->key, 2 * c->own_rate,
                    2 * c->torch_rate, c->torch ? "torch" : "own");
        }
    }
    pthread_mutex_unlock(&lock);
}

/* A claimed call (of a class on torch's GEMM, run with no workspace): counted, and a re-check's sample of
 * either kernel where one is due (opf_provider_begin's, for a call that has no workspace to offer) */
static void claimed_turn(const gemm_call *k, opf_provider_turn *turn) {
    char key[160];
    class_key(k, key, sizeof key);
    pthread_mutex_lock(&lock);
    choice *c = find(key);
    if (c && c->decided && c->torch) recheck_turn(c, turn);
    pthread_mutex_unlock(&lock);
    if (turn->measuring) turn->t0 = opf_now_us();
}

/* A claimed call on opforge's kernels, a re-check's sample: on a workspace of its own, and float32 partial
 * sums where the call writes 16-bit results only and K spans several slices (both touched before the
 * clock starts, as a workspace the op reuses would be); 1, or 0 where they would pass
 * OWN_SAMPLE_MAX_FLOATS or cannot be had (the call is then torch's, unsampled). */
static int own_sample(const gemm_call *k, opf_provider_turn *turn, double work) {
    const gemm_plan *p = k->plan;
    const int sums = !k->c && p->k > gemm_slice_depth(p->kern, p->ta, p->tb);
    const int64_t floats = gemm_workspace(p), total = floats + (sums ? p->m * k->rsc : 0);
    float *ws = total <= OWN_SAMPLE_MAX_FLOATS ? alloc((size_t)total * sizeof(float)) : NULL;
    if (!ws) return 0;
    memset(ws, 0, (size_t)total * sizeof(float));
    turn->t0 = opf_now_us();
    const int rc = gemm_run_own(p, k->a, k->rsa, k->csa, k->b, k->rsb, k->csb, sums ? ws + floats : k->c, k->rsc, k->ep,
                                ws, floats);
    free(ws);
    if (rc == 0) opf_provider_end(turn, work, 0);
    return rc == 0;
}

static int provider_run(const gemm_call *k) {
    const int md = __atomic_load_n(&mode, __ATOMIC_RELAXED);
    if (md == MODE_OWN || !takes(k)) return 0;
    opf_provider_turn turn = {.torch = 1}; /* a claimed call: of a class settled for torch */
    const double work = (double)k->plan->m * (double)k->plan->n * (double)k->plan->k;
    if (!k->claimed) {
        char key[160];
        class_key(k, key, sizeof key);
        opf_provider_begin(key, &turn);
    } else if (md == MODE_AUTO) {
        claimed_turn(k, &turn);
    }
    turn.fused = gemm_epilogue_needed(k->ep); /* a plain product fuses nothing: a near tie goes to the faster */
    if (!turn.torch && k->claimed) {          /* a re-check's sample of opforge's kernel, or torch's unsampled */
        if (own_sample(k, &turn, work)) return 1;
        turn.torch = 1, turn.measuring = 0;
    }
    if (!turn.torch) { /* opforge's kernels, timed here while the class is measured (else declined) */
        if (!turn.measuring) return 0;
        const int rc = gemm_run_own(k->plan, k->a, k->rsa, k->csa, k->b, k->rsb, k->csb, k->c, k->rsc, k->ep,
                                    k->workspace, k->ws_floats);
        opf_provider_end(&turn, work, 0);
        return rc == 0;
    }
    if (run_torch(k) != 0) { /* declined: opforge's kernels run it (a claimed call: the op runs again unclaimed) */
        opf_provider_end(&turn, work, 1);
        opf_log(OPF_LOG_WARNING, "gemm: torch's GEMM failed on a %lld x %lld x %lld product; opforge's kernels run it",
                (long long)k->plan->m, (long long)k->plan->n, (long long)k->plan->k);
        return 0;
    }
    opf_provider_end(&turn, work, 0);
    if (opf_log_enabled(OPF_LOG_INFO)) opf_log_note_pick("gemm", "torch_mm", k->plan->kern->isa);
    return 1;
}

/* Whether auto mode has decided k's class (measured here or read from the cache file); *torch: for
 * torch's GEMM. settled: only where the decision stands (stands()). report: this thread's report of
 * routed calls is counted for the class (once a report). */
static int class_decided(const gemm_call *k, int *torch, int settled, int report) {
    char key[160];
    class_key(k, key, sizeof key);
    pthread_mutex_lock(&lock);
    if (!cache_read) read_cache();
    choice *c = find(key);
    if (report && c && report_id && c->reported != report_id) {
        c->reported = report_id;
        count_routed(c, report_calls);
    }
    const int decided = c && (settled ? stands(c) : c->decided);
    *torch = decided && c->torch;
    pthread_mutex_unlock(&lock);
    return decided;
}

int opf_provider_decided(const char *key, int *torch) {
    pthread_mutex_lock(&lock);
    if (!cache_read) read_cache();
    choice *c = find(key);
    const int decided = c && stands(c);
    *torch = decided && c->torch;
    pthread_mutex_unlock(&lock);
    return decided;
}

/* Mode torch, or a class decided for torch: provider_run runs such a call, marked claimed, on torch's
 * GEMM, which writes the result itself and needs no workspace (or samples opforge's kernel on a
 * workspace of its own for a re-check). */
static int provider_claims(const gemm_call *k) {
    const int md = __atomic_load_n(&mode, __ATOMIC_RELAXED);
    if (md == MODE_OWN || !takes_class(k)) return 0;
    int torch = md == MODE_TORCH;
    return torch || (class_decided(k, &torch, 0, 0) && torch);
}

/* Whether provider_claims' answer is final: modes own and torch, classes torch's GEMM never takes, and
 * classes auto mode has decided are; a class still measured is not, nor one on torch's GEMM in a
 * re-check. Counts this thread's report of routed calls
 * (opf_provider_routed_calls) for the class. */
static int provider_settled(const gemm_call *k) {
    int torch;
    return __atomic_load_n(&mode, __ATOMIC_RELAXED) != MODE_AUTO || !takes_class(k) || class_decided(k, &torch, 1, 1);
}

static const gemm_provider torch_provider = {
    .name = "torch", .run = provider_run, .claims = provider_claims, .settled = provider_settled};

/* ---- setting it up -------------------------------------------------------------- */

static int mode_of(const char *name, char *err, size_t errlen) {
    if (!name || !name[0]) return MODE_AUTO;
    for (int i = 0; i < 3; i++)
        if (strcmp(name, mode_names[i]) == 0) return i;
    snprintf(err, errlen, "OPFORGE_GEMM=%s is not a GEMM provider mode; expected one of own, torch, auto", name);
    return -1;
}

/* Installed as the op library loads (ops.c), in the mode OPFORGE_GEMM names. */
int opf_gemm_torch_install(char *err, size_t errlen) {
    int md = mode_of(getenv("OPFORGE_GEMM"), err, errlen);
    if (md < 0) return -1;
    __atomic_store_n(&mode, md, __ATOMIC_RELAXED);
    gemm_provider_set(&torch_provider);
    return 0;
}

OPF_EXPORT int opforge_set_gemm(const char *name, char *err, size_t errlen) {
    int md = mode_of(name, err, errlen);
    if (md < 0) return -1;
    __atomic_store_n(&mode, md, __ATOMIC_RELAXED);
    return 0;
}

OPF_EXPORT const char *opforge_gemm(void) { return mode_names[__atomic_load_n(&mode, __ATOMIC_RELAXED)]; }

/* The file auto mode keeps its choices in ("": none); its choices are read again from it. */
OPF_EXPORT int opforge_set_gemm_cache(const char *path, char *err, size_t errlen) {
    if (strlen(path) >= sizeof cache_file) {
        snprintf(err, errlen, "the GEMM provider cache path is longer than %zu characters", sizeof cache_file - 1);
        return -1;
    }
    pthread_mutex_lock(&lock);
    snprintf(cache_file, sizeof cache_file, "%s", path);
    nchoices = 0;
    cache_read = 0;
    pthread_mutex_unlock(&lock);
    return 0;
}

/* Class i: its key, state (0 being measured, 1 on opforge's kernels, 2 on torch's), the best
 * rates measured (multiply-adds per nanosecond) and the samples taken, and whether it was measured in
 * this process. 1, or 0 past the last. */
OPF_EXPORT int opforge_gemm_choice_at(int i, char *key, size_t keylen, int *state, double *own_rate, double *torch_rate,
                                      int *samples, int *here) {
    pthread_mutex_lock(&lock);
    if (!cache_read) read_cache();
    int rc = i >= 0 && i < nchoices;
    if (rc) {
        const choice *c = &choices[i];
        snprintf(key, keylen, "%s", c->key);
        *state = !c->decided ? 0 : c->torch ? 2 : 1;
        *own_rate = c->own_rate;
        *torch_rate = c->torch_rate;
        *samples = c->n_own + c->n_torch;
        *here = c->here;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* How opforge's GEMM splits an m x n x k product (float32 operands, or bfloat16 with bf16 set) at a
 * thread count, from its plan, for its first panel of N: out[0] the units of a pass (own A blocks: row
 * blocks; shared A: row slivers x column chunks), out[1] the workers that run them, out[2] row blocks
 * (shared A: row slivers), out[3] column chunks, out[4] panels of N, out[5] the tasks that pack the first
 * K slice of B's panel, out[6] those that pack A's (0: each worker packs its own), out[7] the most tiles
 * (MR x NR) one worker runs in a pass, out[8] the pass's tiles (the idle share is 1 - out[8] /
 * (threads x out[7])), out[9] the K slices a pass runs at once (gemm_plan.ksplit: then a pass's units,
 * packing tasks and tiles are those of all its slices). */
OPF_EXPORT void opforge_gemm_plan(int64_t m, int64_t n, int64_t k, int bf16, int64_t threads, int64_t *out) {
    const opf_dtype dt = bf16 ? OPF_BF16 : OPF_F32;
    const gemm_plan p = gemm_plan_make(gemm_kernels_for(opf_isa_current()), m, n, k, dt, dt, threads);
    const gemm_kernels *kern = p.kern;
    const int64_t nc = n < kern->nc ? n : kern->nc, nslivers = (nc + kern->nr - 1) / kern->nr;
    const int64_t ntn = gemm_col_chunks(&p, nslivers), units = gemm_pass_units(&p, ntn);
    out[0] = units;
    out[1] = gemm_pass_workers(&p, ntn);
    out[2] = p.own_a ? units : p.slivers;
    out[3] = ntn;
    out[4] = (n + kern->nc - 1) / kern->nc;
    /* packing tasks of the first K slice: B's panel, and A's whole when it is shared (0: each worker packs its own) */
    const int64_t max_depth = gemm_slice_depth(kern, dt, dt), kp = gemm_slice_kp(&p, k < max_depth ? k : max_depth);
    const int64_t gb = gemm_pack_grain(kern->nr, kp), ga = gemm_pack_grain(kern->mr, kp);
    const int64_t parts = gemm_pack_b_parts(&p, nslivers, kp);
    out[5] = p.ksplit > 1 ? p.ksplit * nslivers : parts > 1 ? nslivers * parts : (nslivers + gb - 1) / gb;
    out[6] = p.ksplit > 1 ? p.ksplit * p.slivers : p.own_a ? 0 : (p.slivers + ga - 1) / ga;
    out[7] = gemm_pass_most_tiles(&p, nslivers, ntn);
    out[8] = p.slivers * nslivers * p.ksplit;
    out[9] = p.ksplit;
}

/* The class key of matmul's m x n x k product (row-major operands, float32 or bfloat16 with bf16 set,
 * its result of the same type, no epilogue) at a thread count: the key gemm_choices lists it under. */
OPF_EXPORT void opforge_gemm_matmul_key(int64_t m, int64_t n, int64_t k, int bf16, int64_t threads, char *key,
                                        size_t len) {
    const opf_dtype dt = bf16 ? OPF_BF16 : OPF_F32;
    const gemm_plan p = gemm_plan_make(gemm_kernels_for(opf_isa_current()), m, n, k, dt, dt, threads);
    const gemm_epilogue ep = {.out16 = bf16 ? (void *)key : NULL, .out_dt = dt}; /* only its presence is read */
    const gemm_call call = {.plan = &p, .rsa = k, .csa = 1, .rsb = n, .csb = 1, .rsc = n, .ep = &ep};
    class_key(&call, key, len);
}
