/* The table of opforge's own ops, read by the Python layer at import. */
#include <string.h>

#include "opforge/op.h"

extern const opf_op_desc opf_dispersion_correction_ops[2];
extern const opf_op_desc opf_linear_ops[5];
extern const opf_op_desc opf_attention_ops[2];

#define OPF_MAX_OPS 64
static opf_op_desc table[OPF_MAX_OPS];

static int64_t append(int64_t n, const opf_op_desc *ops, int64_t count) {
    memcpy(&table[n], ops, sizeof *ops * (size_t)count);
    return n + count;
}

OPF_EXPORT const opf_op_desc *opforge_op_table(int64_t *count) {
    int64_t n = 0;
    n = append(n, opf_dispersion_correction_ops, 2);
    n = append(n, opf_linear_ops, 5);
    n = append(n, opf_attention_ops, 2);
    *count = n;
    return table;
}
