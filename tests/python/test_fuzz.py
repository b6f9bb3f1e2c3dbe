"""The randomized differential test (fuzz.py), bounded for CI: fixed seeds, a
fixed number of cases each, in two child processes (a crash fails the case
that ran, not the whole pytest run). `make fuzz` runs it on fresh seeds for as long as
asked."""

import pytest

import discover
import fuzz
import opforge

# Cases are drawn per seed and per the CPU's ISA list. On AVX2 machines the
# first cases of these seeds include 16-bit GEMMs over row chunks and linear's
# chunked backward at everyday sizes.
RUNS = {578: 70, 629: 70}


def test_every_forward_op_has_a_fuzz_description():
    """Each op's test module describes it in its FUZZ table (fuzz.Op): one the library has and none covers is
    never drawn."""
    msg = discover.coverage("FUZZ", [name for op in fuzz.descriptions().values() for name in op.covers])
    assert msg is None, msg


@pytest.mark.slow  # the full tier: random cases on fixed seeds
@pytest.mark.parametrize("seed", list(RUNS))
def test_fuzz(seed):
    report = fuzz.run(seed, cases=RUNS[seed], jobs=2, log=lambda *_: None)
    print(report.summary())
    assert report.cases == RUNS[seed]
    assert not report.failures, report.summary()


# Case 55 of seed 629 as a CPU with AMX draws it: bfloat16 attention, B=3 N=S=679, on the avx512_bf16
# variant, which rounds P to bfloat16 before P V; the bound left that rounding out and 12,044 of 260,736
# outputs exceeded it (error / bound 4.7, now 0.19). On an AMX CPU the amx variant runs it, which rounds the
# same operands for its tiles: its own entry in the bound's table (it failed so, 4.7x, on the first AMX
# machine's CI run).
@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512_bf16", "amx"])
def test_fuzz_attention_bfloat16_pairs(isa):
    if isa not in opforge.supported_isas():
        pytest.skip(f"needs {isa}")
    sel = fuzz.Selection(isas=("ref", "avx2", "avx512", "avx512_bf16", "amx"), isa=isa)
    c = fuzz.draw(629, 55, sel)
    assert (c["op"], c["dtype"], c["n"]) == ("attention", "bfloat16", 679)
    res = fuzz.run_case(c)
    assert not res.failures, res.failures
