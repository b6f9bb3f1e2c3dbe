"""`opforge check` explains itself (a user's bf16 check said "1 gradient values out of 4x the tolerance"
and "grad max rel 51.8", naming no gradient; the op was right). Each observation, and the test that pins it:

(1) a FAIL names no output or gradient, nor where: test_a_failure_names_the_gradient_and_its_worst_element,
    test_a_failure_names_the_output_and_its_worst_element
(2) the op got the incoming gradient rounded to bf16, the reference the unrounded one, and a weight gradient
    summing B*L rows of it carried sqrt(B*L) roundings: test_rounding_the_incoming_gradient_is_not_the_ops_error
(3) --atol loosened every dtype at once: test_a_tolerance_per_dtype_loosens_that_dtype_alone,
    test_cli_tolerances_per_dtype
(4) no way to give a scalar argument's value: test_arg_reaches_the_op, test_cli_arg_is_parsed_by_the_schema_type
(5) generated bools were always False (a silu=True path never ran): test_every_bool_combination_is_tried,
    test_every_enum_value_is_tried, test_many_combinations_are_sampled_covering_every_value
"""

import types

import pytest
import torch

import opforge  # noqa: F401  (registers the opforge ops)
import opforge.testing as ot
from opforge.references import dispersion_correction, matmul, rms_norm

MATMUL = torch.ops.opforge.matmul.default
DISPERSION = torch.ops.opforge.dispersion_correction.default
RMS_NORM = torch.ops.opforge.rms_norm.default


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cli(capsys, *argv) -> tuple[int, str]:
    import opforge_cli

    rc = opforge_cli.main(["check", *argv])
    out, err = capsys.readouterr()
    return rc, out + err


# ---- (1) a failure names the output or gradient and its worst element --------------------------


def _wrong_grad_of_b(a, b):
    """The right values, and a gradient of b off at [2, 3] alone (b - b.detach() is zero, its derivative not)."""
    return a @ b + (b - b.detach())[2, 3] * 0.5


def test_a_failure_names_the_gradient_and_its_worst_element():
    report = ot.check(MATMUL, _wrong_grad_of_b, inputs=[(_randn(7, 13, seed=1), _randn(13, 5, seed=2))],
                      dtypes=[torch.float32])
    r = report.results[0]
    assert not report.passed and r.out_of_tolerance == 0 and r.grad_out_of_tolerance == 1
    [(row, m)] = report.failures
    assert row is r and r.mismatches == [m]
    assert m.what == "grad of b" and m.index == (2, 3) and m.shape == (13, 5) and m.count == 1 and m.numel == 13 * 5
    assert abs(m.got - m.want) > m.bound and m.ratio > 1
    assert m.bound == pytest.approx(ot.GRAD_TOLERANCE_FACTOR * (r.atol + r.rtol * abs(m.want)))
    text = str(report)
    assert "1 gradient values out of 4x the tolerance in grad of b" in text
    assert "grad of b: 1 of 65 out of tolerance; worst at [2, 3] of [13, 5]" in text
    assert f"got {m.got:.6g}, want {m.want:.6g}, bound {m.bound:.3g}" in text


def test_a_failure_names_the_output_and_its_worst_element():
    def wrong(a, b):
        y = a @ b
        y[4, 1] += 1e-3
        return y

    report = ot.check(MATMUL, wrong, inputs=[(_randn(7, 13, seed=1), _randn(13, 5, seed=2))],
                      dtypes=[torch.float64], grad=False)
    [(r, m)] = report.failures
    assert (m.what, m.index, m.count, m.numel) == ("output 0", (4, 1), 1, 35)
    assert m.got + 1e-3 == pytest.approx(m.want, abs=1e-12)  # the reference is the one off here
    assert "1 values out of tolerance in output 0" in r.reason and "worst at [4, 1] of [7, 5]" in str(report)


def test_assert_close_names_the_worst_element():
    want = torch.zeros(3, 4, dtype=torch.float64)
    got = want.float().clone()
    got[1, 2], got[2, 0] = 1e-5, 1e-3  # both out of tolerance; the second the worse
    with pytest.raises(AssertionError, match=r"y: 2 of 12 out of tolerance; worst at \[2, 0\] of \[3, 4\]"):
        ot.assert_close(got, want, torch.float32, "y")


# ---- (2) the reference gets the incoming gradient the op gets ----------------------------------------


def _long_reduction(dtype):
    # db = a^T grad sums 4096 rows: the rounding of grad to bfloat16 alone put ~80 elements of it out of
    # 4x the tolerance (where the sum cancels), though the op computes it exactly from what it was given
    return [(_randn(4096, 64, seed=3), _randn(64, 32, seed=4))]


def test_rounding_the_incoming_gradient_is_not_the_ops_error():
    report = ot.check(MATMUL, matmul, inputs=_long_reduction, dtypes=[torch.bfloat16, torch.float16])
    assert report.passed, report
    # the op's one rounding of each sum is within the dtype's own bound: no allowance for the length
    assert all(r.grad_out_of_tolerance == 0 and r.atol == ot.TOLERANCES[r.dtype]["atol"] for r in report.results)


# ---- (3) per-dtype tolerances -------------------------------------------------------------------------


def _off_by_1e5(x, alpha):
    return dispersion_correction(x, alpha) * (1 + 1e-5)


def test_a_tolerance_per_dtype_loosens_that_dtype_alone():
    both = [torch.float32, torch.float64]
    assert not any(r.passed for r in ot.check(DISPERSION, _off_by_1e5, dtypes=both, grad=False).results)
    report = ot.check(DISPERSION, _off_by_1e5, dtypes=both, grad=False, rtol={torch.float32: 1e-4})
    f32, f64 = report.results
    assert f32.passed and f32.rtol == 1e-4
    assert not f64.passed and f64.rtol == ot.TOLERANCES[torch.float64]["rtol"]
    assert ot.tolerance(torch.bfloat16, atol={torch.float32: 1.0}) == ot.TOLERANCES[torch.bfloat16]
    assert ot.tolerance(torch.float32, atol={torch.float32: 1e-9})["atol"] == 1e-6  # never tightens
    assert ot.tolerance(torch.float16, atol=0.5)["atol"] == 0.5  # a float: every dtype


def test_cli_tolerances_per_dtype(tmp_path, capsys):
    import opforge_cli

    ref = tmp_path / "ref.py"
    ref.write_text("from opforge.references import dispersion_correction\n\n"
                   "def off(x, alpha):\n    return dispersion_correction(x, alpha) * (1 + 1e-5)\n")
    rc, out = _cli(capsys, "dispersion_correction", "--reference", f"{ref}:off", "--dtypes", "float32", "float64",
                   "--rtol", "float32=1e-4", "--no-grad")
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("float")}
    assert rc == 1 and "PASS" in rows["float32"] and "rtol 0.0001" in rows["float32"], out
    assert "FAIL" in rows["float64"] and "rtol 1e-12" in rows["float64"], out
    assert opforge_cli._tolerances(["1e-3", "bfloat16=0.05"], "--atol") == {
        torch.float64: 1e-3, torch.float32: 1e-3, torch.bfloat16: 0.05, torch.float16: 1e-3}
    assert opforge_cli._tolerances(["float16=0.5"], "--atol") == {torch.float16: 0.5}
    assert opforge_cli._tolerances(["2e-3"], "--rtol") == 2e-3 and opforge_cli._tolerances(None, "--rtol") is None
    with pytest.raises(SystemExit, match="no dtype 'bf16' \\(one of float64, float32, bfloat16, float16\\)"):
        opforge_cli._tolerances(["bf16=0.05"], "--atol")


# ---- (4) scalar values given ----------------------------------------------------------------------------


def _at_half(x, alpha):
    return dispersion_correction(x, 0.5)  # right only where the op got alpha = 0.5


def test_arg_reaches_the_op(tmp_path, capsys):
    assert not ot.check(DISPERSION, _at_half, dtypes=[torch.float32]).passed  # generated: alpha = 0.8
    assert ot.check(DISPERSION, _at_half, dtypes=[torch.float32], scalars={"alpha": 0.5}).passed
    given = [(torch.rand(5, dtype=torch.float64) + 0.1, 0.8)]  # given inputs: the value given wins too
    assert ot.check(DISPERSION, _at_half, inputs=given, dtypes=[torch.float32], scalars={"alpha": 0.5}).passed
    with pytest.raises(ValueError, match=r"\[opforge::dispersion_correction\] has no scalar argument 'beta' "
                                         r"\(its scalar arguments: alpha: float\)"):
        ot.check(DISPERSION, _at_half, scalars={"beta": 0.5})
    ref = tmp_path / "ref.py"
    ref.write_text("from opforge.references import dispersion_correction\n\n"
                   "def at_half(x, alpha):\n    return dispersion_correction(x, 0.5)\n")
    rc, out = _cli(capsys, "dispersion_correction", "--reference", f"{ref}:at_half", "--dtypes", "float32")
    assert rc == 1, out
    rc, out = _cli(capsys, "dispersion_correction", "--reference", f"{ref}:at_half", "--dtypes", "float32",
                   "--arg", "alpha=0.5")
    assert rc == 0 and "given: alpha=0.5" in out, out


@torch.library.custom_op("opforge_check_explains::scalars", mutates_args=())
def _scalars_op(x: torch.Tensor, f: float, n: int, b: bool, s: str, o: float | None) -> torch.Tensor:
    return x.clone()


def test_cli_arg_is_parsed_by_the_schema_type():
    import opforge_cli

    op = torch.ops.opforge_check_explains.scalars.default
    assert ot.scalar_arguments(op) == {"f": "float", "n": "int", "b": "bool", "s": "str", "o": "float?"}
    got = opforge_cli._scalars(op, ["f=0.5", "n=3", "b=True", "s=silu", "o=none"])
    assert got == {"f": 0.5, "n": 3, "b": True, "s": "silu", "o": None} and type(got["n"]) is int
    assert opforge_cli._scalars(op, ["b=false", "o=2"]) == {"b": False, "o": 2.0}
    with pytest.raises(SystemExit, match="'n' is int, got '1.5'"):
        opforge_cli._scalars(op, ["n=1.5"])
    with pytest.raises(SystemExit, match=r"'b' is bool \(true or false\), got 'yes please'"):
        opforge_cli._scalars(op, ["b=yes please"])
    with pytest.raises(SystemExit, match="scalar argument of opforge_check_explains::scalars .*f: float, n: int"):
        opforge_cli._scalars(op, ["x=1"])


# ---- (5) every combination of the bool and enum arguments ----------------------------------------------


def _rms_norm_without_offset(x, weight, eps, offset):
    return rms_norm(x, weight, eps, False)  # wrong where the op runs with offset (Gemma's 1 + weight)


RMS_SHAPES = {"x": (4, 17), "weight": (17,)}


def test_every_bool_combination_is_tried(tmp_path, capsys):
    report = ot.check(RMS_NORM, _rms_norm_without_offset, dtypes=[torch.float32], shapes=RMS_SHAPES)
    assert report.combinations == [{"offset": False}, {"offset": True}] and report.combinations_total == 2
    assert [(r.combination, r.passed) for r in report.results] == [({"offset": False}, True), ({"offset": True}, False)]
    text = str(report)
    assert "offset=False: PASS" in text and "offset=True: FAIL (float32: output 0, grad of x)" in text, text
    assert "float32 offset=True output 0: 68 of 68 out of tolerance" in text
    fixed = ot.check(RMS_NORM, _rms_norm_without_offset, dtypes=[torch.float32], shapes=RMS_SHAPES,
                     scalars={"offset": False})  # a value given is not swept
    assert fixed.passed and fixed.combinations == [{}] and len(fixed.results) == 1
    ref = tmp_path / "ref.py"
    ref.write_text("from opforge.references import rms_norm\n\n"
                   "def no_offset(x, weight, eps, offset):\n    return rms_norm(x, weight, eps, False)\n")
    rc, out = _cli(capsys, "rms_norm", "--reference", f"{ref}:no_offset", "--dtypes", "float32",
                   "--shape", "x=4,17", "--shape", "weight=17")
    assert rc == 1 and "offset=True: FAIL" in out and "offset=False: PASS" in out, out
    rc, out = _cli(capsys, "rms_norm", "--reference", f"{ref}:no_offset", "--dtypes", "float32",
                   "--shape", "x=4,17", "--shape", "weight=17", "--arg", "offset=false")
    assert rc == 0 and "offset=True" not in out, out
    rc, out = _cli(capsys, "rms_norm", "--dtypes", "float32", "--shape", "x=4,17", "--shape", "weight=17")
    assert rc == 0 and "offset=True: PASS" in out, out  # an op's own reference: --shape generates, and sweeps


LINEAR = torch.ops.opforge.linear.default
LINEAR_SHAPES = ["--shape", "x=4,17", "--shape", "weight=9,17", "--shape", "bias=9"]


@pytest.mark.skipif(not ot._enums(LINEAR), reason="linear takes no str activation with an enum here")
def test_a_str_enum_of_the_library_is_swept_and_given(tmp_path, capsys):
    ref = tmp_path / "ref.py"
    ref.write_text("import torch.nn.functional as F\nfrom opforge.references import linear\n\n"
                   "def no_silu(x, w, b, activation, save_preact):\n"
                   "    return (F.linear(x, w, b),) if activation == 'silu' else linear(x, w, b, activation)\n")
    rc, out = _cli(capsys, "linear", "--reference", f"{ref}:no_silu", "--dtypes", "float32", "--no-grad",
                   "--rtol", "float32=1e-5", "--atol", "float32=1e-5", *LINEAR_SHAPES)
    assert rc == 1 and "activation=silu save_preact=True: FAIL (float32: output 0)" in out, out
    assert "activation=gelu save_preact=False: PASS" in out and "every combination of activation, save_preact" in out
    rc, out = _cli(capsys, "linear", "--reference", f"{ref}:no_silu", "--dtypes", "float32", "--no-grad",
                   "--rtol", "float32=1e-5", "--atol", "float32=1e-5", "--arg", "activation=gelu", *LINEAR_SHAPES)
    assert rc == 0 and "given: activation=gelu" in out and "activation=silu" not in out, out
    with pytest.raises(SystemExit, match="--arg: .*argument 'activation' must be one of none, relu, gelu, gelu_tanh, "
                                         "silu, got 'swish'"):
        _cli(capsys, "linear", "--reference", f"{ref}:no_silu", "--arg", "activation=swish", *LINEAR_SHAPES)


@torch.library.custom_op("opforge_check_explains::pick", mutates_args=())
def _pick(x: torch.Tensor, mode: str, flip: bool) -> torch.Tensor:
    y = {"double": x * 2, "half": x / 2, "neg": -x}[mode]
    return -y if flip else y


PICK = torch.ops.opforge_check_explains.pick.default


def _with_enums(monkeypatch, **enums):
    """The op's descriptor with .enums, as the library gives for a str argument with a fixed set of values."""
    desc = types.SimpleNamespace(enums=tuple(enums.items()))
    monkeypatch.setattr(ot, "_descriptor", lambda op: desc)


def test_every_enum_value_is_tried(monkeypatch):
    _with_enums(monkeypatch, mode=("double", "half", "neg"))
    report = ot.check(PICK, lambda x, mode, flip: _pick(x, mode, flip) + (mode == "neg" and flip),
                      dtypes=[torch.float32], grad=False)
    assert report.combinations_total == 6 and len(report.results) == 6
    assert [_c for _c in report.combinations if _c["mode"] == "neg"] == [{"mode": "neg", "flip": False},
                                                                          {"mode": "neg", "flip": True}]
    failed = [r.combination for r in report.results if not r.passed]
    assert failed == [{"mode": "neg", "flip": True}], report
    assert "mode=neg flip=True: FAIL (float32: output 0)" in str(report)
    assert ot.check(PICK, _pick, dtypes=[torch.float32], grad=False, scalars={"mode": "half"}).combinations == [
        {"flip": False}, {"flip": True}]
    with pytest.raises(ValueError, match=r"argument 'mode' must be one of double, half, neg, got 'triple'"):
        ot.check(PICK, _pick, scalars={"mode": "triple"})


@torch.library.custom_op("opforge_check_explains::five", mutates_args=())
def _five(x: torch.Tensor, a: bool, b: bool, c: bool, d: bool, e: bool) -> torch.Tensor:
    return x.clone()


def test_many_combinations_are_sampled_covering_every_value(monkeypatch):
    op = torch.ops.opforge_check_explains.five.default
    picked, total = ot.combinations(op)
    assert total == 32 and len(picked) == ot.MAX_COMBINATIONS and picked == ot.combinations(op)[0]  # the same each run
    assert picked[0] == dict.fromkeys("abcde", False)
    assert all({c[name] for c in picked} == {False, True} for name in "abcde")
    assert len({tuple(c.values()) for c in picked}) == len(picked)
    report = ot.check(op, lambda x, *flags: x, dtypes=[torch.float32], grad=False)
    assert report.passed and "16 of 32 combinations" in str(report)
    _with_enums(monkeypatch, mode=tuple(f"v{i}" for i in range(20)))  # more values than the cap: each still runs
    picked, total = ot.combinations(PICK)
    assert total == 40 and {c["mode"] for c in picked} == {f"v{i}" for i in range(20)} and len(picked) <= 21
