/*
 * Torch's own kernels as providers (gemm_torch.c): where torch's kernel for a
 * job (its GEMM, its fused CPU attention) is the faster one on this machine
 * for a class of problem, the op runs it instead of opforge's. The mode is
 * OPFORGE_GEMM (own | torch | auto), one for every provider; auto times the
 * first calls of a class on both kernels in turn and keeps the faster, in
 * the process and in the cache file (per CPU model, torch version and build
 * of opforge's library), re-checking it on later calls.
 */
#ifndef OPFORGE_TORCH_PROVIDER_H
#define OPFORGE_TORCH_PROVIDER_H

#include <stdint.h>

#include "opforge/op.h"

enum { OPF_PROVIDER_OWN = 0, OPF_PROVIDER_TORCH, OPF_PROVIDER_AUTO };

int opf_provider_mode(void);

/* A CPU tensor over opforge's buffer (float32 or bfloat16, any sizes and strides), for torch's
 * kernel to read or write; NULL when torch refuses it. */
AtenTensorHandle opf_provider_wrap(const void *data, int64_t ndim, const int64_t *sizes, const int64_t *strides,
                                   opf_dtype dt);
/* Deletes the n handles that are set, and clears them. */
void opf_provider_release(AtenTensorHandle *h, int n);

/* log2 of v rounded up: the size buckets of the classes' keys */
static inline int opf_provider_log2_up(int64_t v) {
    int b = 0;
    while (b < 40 && ((int64_t)1 << b) < v) b++;
    return b;
}

/* One call of a job that a provider may run. */
typedef struct opf_provider_turn {
    int torch;     /* 1: the call runs torch's kernel */
    int measuring; /* the call is a sample of its class: time it between begin and end */
    int fused;     /* 1 (begin's default): opforge's kernel fuses work torch's leaves to another pass (an
                      epilogue): a near tie (within 3%) stays with it; 0 (the caller's, before end): it
                      must be 5% faster than torch's */
    double t0;
    char key[160];
} opf_provider_turn;

/* Which kernel this call of the class `key` (a line of text naming the job and what sets its speed)
 * runs, into turn (and returned: 1 torch's): by the mode; in auto mode by the class's choice (this
 * process's, or the cache file's), or, while the class is being measured, the side with fewer
 * samples. */
int opf_provider_begin(const char *key, opf_provider_turn *turn);

/* Whether auto mode has decided the class `key` (measured in this process or read from the cache file),
 * and the decision stands (not a class on torch's kernel waiting for a re-check's sample of opforge's);
 * *torch: for torch's kernel. */
int opf_provider_decided(const char *key, int *torch);

/* Counts `calls` calls of the class `key` (decided for torch's kernel) that the Python layer sent to
 * torch's own function in the op's stead, since it last said: where they reach a re-check, the class is
 * unsettled (opf_provider_decided: 0) until the op's next calls of it have taken the re-check's samples.
 * Auto mode only. */
void opf_provider_routed(const char *key, int64_t calls);

/* The same for the GEMM classes this thread's next claims of plans ask about (each class counted once):
 * set before the claims, and cleared (0) after them. */
void opf_provider_routed_calls(int64_t calls);

/* After the call: records a measuring call's time over `work` (multiply-adds, or any measure of the
 * call's size that the class's calls share), or, with failed, that torch's kernel could not run it
 * (the class stays with opforge's). Past SAMPLES calls of each kernel the class is decided and saved
 * (up to MORE_SAMPLES while the two are within 8% of the margin's line). */
void opf_provider_end(const opf_provider_turn *turn, double work, int failed);

/* plan = make, claim (the products the GEMM provider runs itself need no workspace), then run (an
 * expression of plan, ws and wsn) on a workspace of the plan's size; where run returns declined (the
 * provider declined a claimed product after all: its mode changed since, its GEMM failed, before any
 * output is final), plan = make again, unclaimed, and run once more on its workspace. Any other nonzero
 * result is a kernel refusing a workspace sized for another problem: a bug of ours, which the error names
 * instead of writing past the workspace. */
#define OPF_RUN_CLAIMED(op, like, plan, workspace_of, make, claim, run, declined)                            \
    do {                                                                                                     \
        (plan) = (make);                                                                                     \
        claim;                                                                                               \
        float *ws = NULL;                                                                                    \
        int64_t wsn = workspace_of(&(plan));                                                                 \
        OPF_OWNED AtenTensorHandle ws_h = opf_workspace((op), wsn, (like), &ws);                             \
        int rc = (run);                                                                                      \
        if (rc == (declined)) {                                                                              \
            (plan) = (make);                                                                                 \
            wsn = workspace_of(&(plan));                                                                     \
            OPF_OWNED AtenTensorHandle ws2_h = opf_workspace((op), wsn, (like), &ws);                        \
            rc = (run);                                                                                      \
        }                                                                                                    \
        if (rc != 0)                                                                                         \
            opf_fail((op), "internal error: the workspace is smaller than the plan needs (please report it " \
                           "with the shapes)");                                                              \
    } while (0)

#endif
