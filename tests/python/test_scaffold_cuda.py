"""`opforge new NAME --cuda`: the CUDA kernels it writes compute what its C kernels compute, checked on the
CPU over opforge's CUDA emulation (tests/emu/cuda_emu.h), for both kinds of op (elementwise over any
strides; a reduction of the last dim, a block per row); and the project builds with nvcc and registers its
CUDA kernels where nvcc is (its own tests, GPU ones included, run in test_toolkit's walk-through)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from opforge import _build, scaffold

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNTIME = [os.path.join(ROOT, "csrc", "runtime", f) for f in sorted(os.listdir(os.path.join(ROOT, "csrc", "runtime")))]

ELEMENTWISE = r"""
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "opforge/cuda_types.h"

unsigned sq_cuda_fwd(opf_dtype dt, void *y, const void *const *in, const opf_cuda_nd *nd, float alpha, void *stream);
unsigned sq_cuda_bwd(opf_dtype dt, void *const *dx, const void *g, const void *const *in, const opf_cuda_nd *nd,
                     float alpha, void *stream);

int main(void) {
    enum { R = 7, C = 9 };
    static float abuf[C * R], b[R * C], y[R * C], g[C], da[R * C], db[R * C];
    for (int i = 0; i < R * C; i++) abuf[i] = (float)(i % 11) * 0.25f - 1.0f, b[i] = (float)(i % 5) - 2.0f;
    for (int j = 0; j < C; j++) g[j] = 0.5f + j;
    const float alpha = 0.75f;
    /* a: the transpose of a (C, R) buffer; b, y: contiguous; g: one row broadcast over the rows */
    const int64_t sizes[] = {R, C}, as[] = {1, R}, cs[] = {C, 1}, gs[] = {0, 1};
    opf_cuda_nd nd;
    int bad = 0;
    if (opf_cuda_nd_make(&nd, 2, sizes, 3, (const int64_t *const[]){cs, as, cs})) return 2;
    sq_cuda_fwd(OPF_F32, y, (const void *const[]){abuf, b}, &nd, alpha, NULL);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float a = abuf[c * R + r], bb = b[r * C + c];
            bad += fabsf(y[r * C + c] - alpha * (a * a + bb * bb)) > 1e-5f;
        }
    if (opf_cuda_nd_make(&nd, 2, sizes, 5, (const int64_t *const[]){cs, cs, gs, as, cs})) return 2;
    sq_cuda_bwd(OPF_F32, (void *const[]){da, db}, g, (const void *const[]){abuf, b}, &nd, alpha, NULL);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            bad += fabsf(da[r * C + c] - 2 * alpha * abuf[c * R + r] * g[c]) > 1e-5f;
            bad += fabsf(db[r * C + c] - 2 * alpha * b[r * C + c] * g[c]) > 1e-5f;
        }
    printf("%d bad\n", bad);
    return bad != 0;
}
"""

REDUCTION = r"""
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "opforge/cuda_types.h"

unsigned rd_cuda_fwd(opf_dtype dt, void *y, const void *const *in, const opf_cuda_nd *nd, int64_t cols,
                     const int64_t *cs, void *stream);
unsigned rd_cuda_bwd(opf_dtype dt, void *const *dx, const void *g, const void *const *in, const opf_cuda_nd *nd,
                     int64_t cols, const int64_t *cs, void *stream);

int main(void) {
    enum { R = 5, C = 300 };
    static float abuf[R * C * 2], b[R * C], y[R], g[R], da[R * C], db[R * C];
    for (int i = 0; i < R * C * 2; i++) abuf[i] = (float)(i % 13) * 0.125f - 0.5f;
    for (int i = 0; i < R * C; i++) b[i] = (float)(i % 7) * 0.25f - 0.75f;
    for (int r = 0; r < R; r++) g[r] = 1.0f + r;
    /* a: every other element of a (R, 2C) buffer; b contiguous; rows over the leading dim */
    const int64_t lead[] = {R}, ys[] = {1}, as[] = {2 * C}, bs[] = {C}, gs[] = {1};
    opf_cuda_nd nd;
    int bad = 0;
    if (opf_cuda_nd_make(&nd, 1, lead, 3, (const int64_t *const[]){ys, as, bs})) return 2;
    rd_cuda_fwd(OPF_F32, y, (const void *const[]){abuf, b}, &nd, C, (const int64_t[]){2, 1}, NULL);
    for (int r = 0; r < R; r++) {
        double want = 0;
        for (int c = 0; c < C; c++) {
            double a = abuf[r * 2 * C + 2 * c], bb = b[r * C + c];
            want += a * a + bb * bb;
        }
        bad += fabs(y[r] - want) > 1e-3 * (1 + fabs(want));
    }
    if (opf_cuda_nd_make(&nd, 1, lead, 5, (const int64_t *const[]){bs, bs, gs, as, bs})) return 2;
    rd_cuda_bwd(OPF_F32, (void *const[]){da, db}, g, (const void *const[]){abuf, b}, &nd, C,
                (const int64_t[]){1, 1, 2, 1}, NULL);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            bad += fabsf(da[r * C + c] - 2 * g[r] * abuf[r * 2 * C + 2 * c]) > 1e-5f;
            bad += fabsf(db[r * C + c] - 2 * g[r] * b[r * C + c]) > 1e-5f;
        }
    printf("%d bad\n", bad);
    return bad != 0;
}
"""


@pytest.mark.parametrize("name, inputs, scalars, reduce, harness", [
    ("sq", "a,b", "alpha:float", None, ELEMENTWISE),
    ("rd", "a,b", None, "last", REDUCTION),
], ids=["elementwise", "reduction"])
def test_generated_cuda_kernels_compute_the_placeholder(tmp_path, name, inputs, scalars, reduce, harness):
    sig = scaffold.Signature.parse(name, inputs, scalars, reduce)
    sig.cuda = True
    files = scaffold.files(sig)
    cu = tmp_path / f"{name}.cu"
    cu.write_text(files[f"{name}.cu"])
    main = tmp_path / "harness.c"
    main.write_text(harness)
    exe = tmp_path / "harness"
    _build.build_emulated_cuda_test([str(main), *RUNTIME], [str(cu)], str(exe), [os.path.join(ROOT, "csrc", "include")],
                                    str(tmp_path / "obj"))
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_without_cuda_the_descriptor_has_no_cuda_kernel():
    sig = scaffold.Signature.parse("plain", None, None, None)
    files = scaffold.files(sig)
    assert "plain.cu" not in files
    assert "#define PLAIN_CUDA NULL" in files["plain.c"] and "opforge/cuda.h" not in files["plain.c"]


@pytest.mark.slow
def test_cuda_project_builds_and_registers_its_cuda_kernels(tmp_path):
    """With nvcc here: the project's ops.py builds NAME.cu and the ops get CUDA kernels (registration needs
    no GPU); its tests pass (the GPU ones skip without a GPU)."""
    if _build.nvcc() is None:
        pytest.skip("no nvcc on this machine")
    from opforge_cli import new

    dest = new("sqc", str(tmp_path), "a,b", "alpha:float", None, cuda=True)
    env = dict(os.environ, OPFORGE_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import ops, torch; print(torch._C._dispatch_has_kernel_for_dispatch_key('sqc::sqc', 'CUDA'), "
            "torch._C._dispatch_has_kernel_for_dispatch_key('sqc::sqc_backward', 'CUDA'))")
    r = subprocess.run([os.sys.executable, "-c", code], cwd=dest, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True"], r.stdout + r.stderr
    r = subprocess.run([os.sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"], cwd=dest,
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:]
    assert torch.cuda.is_available() or "skipped" in r.stdout
