"""Enums in C: a `str` schema argument with a fixed set of values (the descriptor's .enums), which the
kernel reads as the value's index with opf_arg_enum. Direct calls with the names, the refusal of an
unknown value (eager, fake, torch.compile, with the C's message), schema defaults, the checks at load,
the shape rules' `if`, opcheck, and torch.export / AOTInductor of the migrated linear and glu."""

import re

import pytest
import torch
import torch.nn.functional as TF
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import opforge
from opforge import _lib, _shape
from opforge.aoti import c_parameters

NS = opforge.namespace
GLU_MSG = f"[{NS}::glu] argument 'act' must be one of 'gelu', 'gelu_tanh', 'silu', got 'relu'"
LINEAR_MSG = (f"[{NS}::linear] argument 'activation' must be one of 'none', 'relu', 'gelu', 'gelu_tanh', "
              "'silu', got 'swish'")

# a user op with two enums, one optional, both with defaults, and no .meta: its fake kernel is the
# Python one, which must refuse what the C refuses, with the same message
PICK = r"""
#include "opforge/op.h"

#define OP "enum_ops::pick"
#define MODES "add|mul|keep"
#define FLAVOURS "sweet | sour"

/* every element 10 * index(mode) + index(flavour) (-1: None): the indices the kernel got */
static void pick_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    OPF_ARG_TENSOR(x, stack, 0);
    int mode = opf_arg_enum(OP, "mode", stack[1], MODES);
    int flavour = opf_arg_optional_enum(OP, "flavour", stack[2], FLAVOURS);
    opf_tensor t = opf_tensor_info(OP, "x", x_h);
    opf_check_dtype(OP, "x", &t, OPF_DTYPE_BIT(OPF_F32));
    OPF_OWNED AtenTensorHandle out_h = opf_empty_like(OP, &t);
    opf_tensor out = opf_tensor_info(OP, "out", out_h);
    for (int64_t i = 0; i < out.numel; i++) ((float *)out.data)[i] = (float)(10 * mode + flavour);
    OPF_RETURN(stack, 0, out_h);
}

OPF_OP_TABLE({.schema = "pick(Tensor x, str mode=\"keep\", str? flavour=None) -> Tensor",
              .cpu = pick_cpu,
              .shape = "like:x",
              .enums = "mode: " MODES "; flavour: " FLAVOURS})
"""


@pytest.fixture(scope="module")
def pick(tmp_path_factory):
    d = tmp_path_factory.mktemp("enum_ops")
    src = d / "pick.c"
    src.write_text(PICK)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPFORGE_CACHE_DIR", str(d / "cache"))
        lib = opforge.load("enum_ops", [str(src)])
    return lib.descriptor("pick"), torch.ops.enum_ops.pick.default


# ---- the built-in ops take the names -----------------------------------------------------------


def test_the_ops_take_the_names_directly():
    g, u = torch.randn(3, 7), torch.randn(3, 7)
    torch.testing.assert_close(torch.ops.opforge.glu(g, u, "silu"), TF.silu(g) * u)
    torch.testing.assert_close(torch.ops.opforge.glu(g, u, "gelu_tanh"), TF.gelu(g, approximate="tanh") * u)
    x, w, b = torch.randn(4, 7), torch.randn(5, 7), torch.randn(5)
    out, pre = torch.ops.opforge.linear(x, w, b, "gelu")
    torch.testing.assert_close(out, TF.gelu(TF.linear(x, w, b)), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(pre, TF.linear(x, w, b), rtol=2e-5, atol=2e-5)
    assert torch.ops.opforge.linear(x, w, b, "none")[1].numel() == 0  # "none" is the 0 the C sees: nothing saved


def test_the_descriptors_state_the_values():
    glu, linear = opforge.library.descriptor("glu"), opforge.library.descriptor("linear")
    assert glu.enums == (("act", ("gelu", "gelu_tanh", "silu")),)
    assert glu.enum_values("act") == opforge.functional.GLU_ACTIVATIONS
    assert linear.enum_values("activation") == ("none", "relu", "gelu", "gelu_tanh", "silu")
    assert linear.enum_values("activation") == opforge.functional.ACTIVATIONS
    assert linear.enum_values("x") is None
    for name in ("glu_backward", "linear_backward", "linear_backward_"):
        assert opforge.library.descriptor(name).enums, name
    with pytest.raises(KeyError, match="has no op 'nope'"):
        opforge.library.descriptor("nope")


_BAD_CALLS = {
    "glu": (lambda: torch.ops.opforge.glu(torch.rand(3), torch.rand(3), "relu"), GLU_MSG),
    "glu_backward": (lambda: torch.ops.opforge.glu_backward(torch.rand(3), torch.rand(3), torch.rand(3), "relu"),
                     GLU_MSG.replace("::glu]", "::glu_backward]")),
    "linear": (lambda: torch.ops.opforge.linear(torch.randn(3, 5), torch.randn(4, 5), None, "swish"), LINEAR_MSG),
    "linear_backward": (lambda: torch.ops.opforge.linear_backward(torch.randn(3, 4), torch.randn(3, 5),
                                                                  torch.randn(4, 5), None, torch.randn(3, 4), "swish"),
                        LINEAR_MSG.replace("::linear]", "::linear_backward]")),
    "functional": (lambda: opforge.linear(torch.randn(3, 5), torch.randn(4, 5), None, "swish"), LINEAR_MSG),
}


@pytest.mark.parametrize("name", list(_BAD_CALLS))
def test_an_unknown_value_names_op_argument_every_value_and_what_was_given(name):
    call, msg = _BAD_CALLS[name]
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        call()
    with FakeTensorMode(), pytest.raises(RuntimeError, match=re.escape(msg)):
        call()


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_refuses_an_unknown_value_as_eager(dynamic):
    g = torch.randn(3, 8)
    ok = torch.compile(lambda t: torch.ops.opforge.glu(t, t, "gelu") + 1, fullgraph=True, dynamic=dynamic)
    torch.testing.assert_close(ok(g), TF.gelu(g) * g + 1)
    bad = torch.compile(lambda t: torch.ops.opforge.glu(t, t, "relu") + 1, fullgraph=True, dynamic=dynamic)
    with pytest.raises(RuntimeError, match=re.escape(GLU_MSG)):
        bad(g)


def test_the_module_refuses_an_unknown_activation_when_made():
    with pytest.raises(RuntimeError, match=re.escape(LINEAR_MSG.replace("'swish'", "'tanh'"))):
        opforge.nn.Linear(4, 4, activation="tanh")
    assert opforge.nn.Linear(4, 4, activation=None)(torch.randn(2, 4)).shape == (2, 4)


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_opcheck_on_the_migrated_ops(act):
    g, u = torch.randn(5, 6), torch.randn(5, 6)
    opcheck(torch.ops.opforge.glu.default, (g, u, act))
    opcheck(torch.ops.opforge.glu.default, (g.clone().requires_grad_(), u.clone().requires_grad_(), act))
    x, w, b = torch.randn(3, 7), torch.randn(4, 7), torch.randn(4)
    opcheck(torch.ops.opforge.linear.default, (x, w, b, act))
    opcheck(torch.ops.opforge.linear.default, (x.requires_grad_(), w.requires_grad_(), b, act, True))


# ---- a user op: defaults, an optional enum, the Python fake kernel --------------------------------


def test_defaults_and_optional_values_reach_the_kernel_as_indices(pick):
    desc, op = pick
    assert desc.enums == (("mode", ("add", "mul", "keep")), ("flavour", ("sweet", "sour")))
    x = torch.zeros(2, 3)
    assert torch.equal(op(x), torch.full_like(x, 19))  # mode "keep" (2), flavour None (-1)
    assert torch.equal(op(x, "add"), torch.full_like(x, -1))
    assert torch.equal(op(x, "mul", "sour"), torch.full_like(x, 11))
    assert torch.equal(op(x, flavour="sweet"), torch.full_like(x, 20))
    compiled = torch.compile(lambda t: op(t) + op(t, "mul", "sweet"), fullgraph=True)
    assert torch.equal(compiled(x), torch.full_like(x, 29))


@pytest.mark.parametrize(
    "args, msg",
    [
        (("div",), "[enum_ops::pick] argument 'mode' must be one of 'add', 'mul', 'keep', got 'div'"),
        (("add", "bitter"), "[enum_ops::pick] argument 'flavour' must be one of 'sweet', 'sour', got 'bitter'"),
        (("",), "[enum_ops::pick] argument 'mode' must be one of 'add', 'mul', 'keep', got ''"),
    ],
)
def test_the_python_fake_kernel_gives_the_c_message(pick, args, msg):
    _, op = pick
    x = torch.zeros(4)
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        op(x, *args)
    with FakeTensorMode(), pytest.raises(RuntimeError, match=re.escape(msg)):  # no .meta: Python's check
        op(torch.zeros(4), *args)
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        torch.compile(lambda t: op(t, *args), fullgraph=True)(x)


def test_opcheck_on_a_user_enum_op(pick):
    _, op = pick
    for args in ((), ("mul",), ("add", "sour")):
        opcheck(op, (torch.randn(3, 5), *args))


BAD_LIBRARY = r"""
#include "opforge/op.h"

static void k(StableIValue *stack, uint64_t nin, uint64_t nout) {}

OPF_OP_TABLE({.schema = "fine(Tensor x) -> Tensor", .cpu = k, .shape = "like:x"},
             {.schema = SCHEMA, .cpu = k, .shape = "like:x", .enums = "mode: a|b"})
"""


@pytest.mark.parametrize(
    "namespace, schema, why",
    [
        ("bad_enum_type", r"f(Tensor x, int mode) -> Tensor", "argument 'mode' is int, not str"),
        ("bad_enum_default", r"f(Tensor x, str mode=\"c\") -> Tensor",
         "the schema's default 'c' of 'mode' is not one of the values"),
    ],
)
def test_a_bad_enum_fails_when_the_library_loads(tmp_path, monkeypatch, namespace, schema, why):
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / f"{namespace}.c"
    src.write_text(BAD_LIBRARY.replace("SCHEMA", f'"{schema}"'))
    with pytest.raises(RuntimeError, match=re.escape(f"[{namespace}::f] bad .enums entry 'mode: a|b': {why}")):
        opforge.load(namespace, [str(src)])
    assert not hasattr(getattr(torch.ops, namespace), "fine")  # checked before anything was registered


SCHEMA = torch._C.parse_schema('op(Tensor x, str mode="a", str? opt=None, int n=1, str free="x") -> Tensor')


@pytest.mark.parametrize(
    "text, why",
    [
        ("mode a|b", "expected 'ARG: VALUE|VALUE|...'"),
        ("nope: a|b", "the schema has no argument 'nope' (it has x, mode, opt, n, free)"),
        ("n: a|b", "argument 'n' is int, not str"),
        ("x: a|b", "argument 'x' is Tensor, not str"),
        ("mode: a|b; mode: a", "argument 'mode' is listed twice"),
        ("mode: a||b", "each value must be a non-empty identifier"),
        ("mode: a|b c", "each value must be a non-empty identifier"),
        ("mode:", "each value must be a non-empty identifier"),
        ("mode: a|b|a", "a value is listed twice"),
        ("mode: b|c", "the schema's default 'a' of 'mode' is not one of the values"),
    ],
)
def test_enum_entries_are_checked_against_the_schema(text, why):
    with pytest.raises(RuntimeError, match=r"\[ns::op\] bad \.enums entry .*" + re.escape(why)):
        _lib._enums("ns::op", SCHEMA, text)


def test_enum_entries_that_fit():
    assert _lib._enums("ns::op", SCHEMA, " mode: a | b ;opt: x|y; ") == (("mode", ("a", "b")), ("opt", ("x", "y")))
    assert _lib._enums("ns::op", SCHEMA, None) == ()  # a free-form str argument (free) needs no entry


def test_in_a_shape_rule_the_first_value_is_false():
    schema = torch._C.parse_schema("op(Tensor x, str act, bool save=True) -> Tensor")
    (rule,) = _shape.compile_rules("ns::op", schema, "[x[:]] if act and save", {"act": ("none", "gelu")})
    x = torch.randn(2, 3)
    assert rule.evaluate((x, "gelu")).shape == (2, 3)
    assert rule.evaluate((x, "none")).shape == (0,)
    assert rule.evaluate((x, "gelu", False)).shape == (0,)


def test_aoti_shims_take_c_strings():
    schema = torch._C.parse_schema("f(Tensor x, str a, str? b) -> Tensor")
    assert c_parameters(schema).replace(" ", "") == "AtenTensorHandlex,constchar*a,constchar**b"


# ---- torch.export and AOTInductor ------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(torch.randn(12, 6)), torch.nn.Parameter(torch.randn(12))

    def forward(self, x):
        h = opforge.linear(x, self.w, self.b, "gelu")
        return opforge.functional.geglu(h, approximate="tanh"), opforge.linear(x, self.w, None, "relu")


def _export():
    model = _Block().eval()
    with torch.no_grad():
        return model, torch.export.export(model, (torch.randn(2, 5, 6),))


def test_export_keeps_the_names_and_runs():
    model, ep = _export()
    code = ep.graph_module.code
    assert "'gelu'" in code and "'relu'" in code and "'gelu_tanh'" in code, code
    x = torch.randn(2, 5, 6)
    with torch.no_grad():
        for got, want in zip(ep.module()(x), model(x)):
            torch.testing.assert_close(got, want)


@pytest.mark.slow  # AOTInductor compiles C++
def test_aoti_calls_the_c_shims_with_the_names(tmp_path):
    import zipfile

    model, ep = _export()
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(tmp_path / "model.pt2"),
        inductor_configs={**opforge.aoti_config(), "aot_inductor.compile_wrapper_opt_level": "O0"})
    with zipfile.ZipFile(path) as z:
        src = next(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))
    for op in ("linear", "glu"):
        assert f"aoti_torch_cpu_{op}(" in src, op
    assert '"gelu"' in src and '"gelu_tanh"' in src, src
    runner = torch._inductor.aoti_load_package(path)
    x = torch.randn(2, 5, 6)  # the exported (static) shape
    with torch.no_grad():
        for got, want in zip(runner(x), model(x)):
            torch.testing.assert_close(got, want)
