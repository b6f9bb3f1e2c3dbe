/*
 * What the glue of attention (attention.c) shares with attention_decode's:
 * the scale argument of both ops.
 */
#ifndef OPFORGE_TORCH_ATTENTION_H
#define OPFORGE_TORCH_ATTENTION_H

#include <stdint.h>

#include "opforge/op.h"

/* The scores' scale: the given one (has_scale), which must be finite in the
 * type the kernels compute in (float64 for float64 inputs, else float32: the
 * kernels round it once), else 1 / sqrt(head_dim) (1 for head_dim 0). An
 * infinite or NaN scale fails op with a message naming the argument. */
double attention_scale(const char *op, opf_dtype dt, int has_scale, double scale, int64_t head_dim);

#endif
