"""PyTorch references of opforge's ops and their per-dtype tolerances.

The benchmarks import their baselines from here, so what is timed is what is
tested.
"""

import torch


def dispersion_correction(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """The brief's reference: y = x * alpha + sqrt(x)."""
    return x * alpha + torch.sqrt(x)


# |opforge - float64 reference| <= atol + rtol * |reference|. Half types are
# computed in fp32 and rounded once, so the bound is half an ulp of the type.
TOLERANCES = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=1e-6, rtol=1e-6),
    torch.bfloat16: dict(atol=1e-2, rtol=4e-3),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
}

DTYPES = list(TOLERANCES)


def assert_close(got: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Compares with the float64 reference; on failure names the worst element."""
    tol = TOLERANCES[dtype]
    got64 = got.double()
    err = (got64 - want64).abs()
    bound = tol["atol"] + tol["rtol"] * want64.abs()
    both_nan = got64.isnan() & want64.isnan()
    same_inf = (got64 == want64) & want64.isinf()
    bad = ~((err <= bound) | both_nan | same_inf)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(
            f"{what} {dtype}: {int(bad.sum())} of {bad.numel()} elements out of tolerance {tol}; "
            f"first at flat index {i}: got {got64.flatten()[i].item()!r}, want {want64.flatten()[i].item()!r}; "
            f"max error {err[~both_nan & ~same_inf].max().item() if (~both_nan & ~same_inf).any() else 0.0}"
        )
