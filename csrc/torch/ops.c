/* The table of opforge's own ops, read by the Python layer at import. */
#include <stdio.h>

#include "opforge/op.h"

/* Each op file's table, ended by OPF_OP_END. */
extern const opf_op_desc opf_dispersion_correction_ops[];
extern const opf_op_desc opf_linear_ops[];
extern const opf_op_desc opf_attention_ops[];
extern const opf_op_desc opf_norm_ops[];
extern const opf_op_desc opf_glu_ops[];
extern const opf_op_desc opf_rope_ops[];
extern const opf_op_desc opf_softmax_ops[];
extern const opf_op_desc opf_cross_entropy_ops[];
extern const opf_op_desc opf_linear_cross_entropy_ops[];
extern const opf_op_desc opf_attention_decode_ops[];

static const opf_op_desc *const groups[] = {opf_dispersion_correction_ops,
                                            opf_linear_ops,
                                            opf_attention_ops,
                                            opf_norm_ops,
                                            opf_glu_ops,
                                            opf_rope_ops,
                                            opf_softmax_ops,
                                            opf_cross_entropy_ops,
                                            opf_linear_cross_entropy_ops,
                                            opf_attention_decode_ops};

#define OPF_MAX_OPS 64
static opf_op_desc table[OPF_MAX_OPS + 1]; /* and its end */

OPF_EXPORT const opf_op_desc *opforge_op_table(char *err, size_t errlen) {
    int n = 0;
    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++) {
        for (const opf_op_desc *op = groups[g]; op->schema; op++) {
            if (n == OPF_MAX_OPS) {
                snprintf(err, errlen, "more than OPF_MAX_OPS (%d) ops in opforge's table (csrc/torch/ops.c): raise it",
                         OPF_MAX_OPS);
                return NULL;
            }
            table[n++] = *op;
        }
    }
    table[n] = (opf_op_desc)OPF_OP_END;
    return table;
}
