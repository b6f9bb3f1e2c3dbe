/*
 * Paging in large fresh CPU outputs (pages.c): the mode, OPFORGE_PAGES or opforge_set_pages
 * (touch | populate | huge), and the call opf_empty_strided makes on each output.
 */
#ifndef OPFORGE_TORCH_PAGES_H
#define OPFORGE_TORCH_PAGES_H

#include <stddef.h>
#include <stdint.h>

#include "opforge/op.h"

/* Reads OPFORGE_PAGES at load (opforge_init): 0, or -1 with the reason in err. */
int opf_pages_init(char *err, size_t errlen);

/* A CPU output of 4 MiB or more whose first, middle and last pages are not resident: paged in as
 * the mode says (populated by the threads, with huge pages advised first in mode huge). */
void opf_page_in(AtenTensorHandle out, int64_t ndim, const int64_t *sizes, const int64_t *strides, int32_t dtype);

OPF_EXPORT int opforge_set_pages(const char *name, char *err, size_t errlen);
OPF_EXPORT const char *opforge_pages(void);

#endif
