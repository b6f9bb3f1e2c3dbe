/*
 * Torch's own kernels as providers (gemm_torch.c): where torch's kernel for a
 * job (its GEMM, its fused CPU attention) is the faster one on this machine
 * for a class of problem, the op runs it instead of opforge's. The mode is
 * OPFORGE_GEMM (own | torch | auto), one for every provider; auto measures
 * both the first time a class is met and keeps the choice for the process
 * and in the cache file (per CPU model and torch version).
 */
#ifndef OPFORGE_TORCH_PROVIDER_H
#define OPFORGE_TORCH_PROVIDER_H

enum { OPF_PROVIDER_OWN = 0, OPF_PROVIDER_TORCH, OPF_PROVIDER_AUTO };

int opf_provider_mode(void);

/* 1: the class `key` (a line of text naming the job and what sets its speed)
 * runs on torch's kernel: by the mode, or in auto mode by the choice known
 * for the class (this process, the cache file), or measured now by
 * measure(ctx, &t_own, &t_torch) (microseconds; 0 on success, else the class
 * stays with opforge's kernels for the process). One class is measured at a
 * time, within the process's measuring budget (past it: opforge's kernels). */
int opf_provider_torch(const char *key, int (*measure)(void *ctx, double *t_own, double *t_torch), void *ctx);

#endif
