"""The shape notation of descriptors (csrc/include/opforge/op.h): the evaluator on
concrete and symbolic sizes, its checks when a library loads, and
torch.compile(dynamic=True) of the ops whose fake outputs it describes."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import opforge
from opforge import _lib, _shape

SCHEMA = torch._C.parse_schema(
    "op(Tensor x, Tensor weight, Tensor? bias, int activation, bool save_preact=True) -> Tensor"
)


def rule(text, schema=SCHEMA):
    return _shape.compile_rules("ns::op", schema, text)[0]


# ---- the evaluator on concrete sizes ------------------------------------------------


@pytest.mark.parametrize(
    "text, want",
    [
        ("[x[:-1], weight[0]]", (2, 3, 7)),
        ("[x[:]]", (2, 3, 5)),
        ("[x[1:]]", (3, 5)),
        ("[x[-1], 4, x[0]]", (5, 4, 2)),
        ("[] dtype=x", ()),
        ("[0] dtype=x", (0,)),
    ],
)
def test_sizes_from_argument_sizes_and_integers(text, want):
    x, w = torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(7, 5)
    out = rule(text).evaluate((x, w, None, 0, True))
    assert out.shape == want and out.dtype == torch.float64 and out.is_contiguous()


def test_dtype_from_an_argument_or_fixed():
    x, w = torch.randn(2, 5, dtype=torch.float16), torch.randn(7, 5)
    assert rule("[x[:-1], weight[0]] dtype=weight").evaluate((x, w, None, 0)).dtype == torch.float32
    assert rule("[x[:-1]] dtype=int64").evaluate((x, w, None, 0)).dtype == torch.int64
    assert rule("[weight[0]]").evaluate((x, w, None, 0)).dtype == torch.float32  # the first argument named


@pytest.mark.parametrize("xdt, want", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                       (torch.float32, torch.float32), (torch.float64, torch.float64)], ids=str)
def test_dtype_promoted(xdt, want):
    # a float32 loss of 16-bit operands, float64 of float64 ones (linear_cross_entropy's)
    x, w, b = torch.randn(2, 5, dtype=xdt), torch.randn(7, 5, dtype=torch.bfloat16), torch.randn(7, dtype=torch.float64)
    assert rule("[] dtype=promote(x,float32)").evaluate((x, w, None, 0)).dtype == want
    assert rule("[x[:-1]] dtype=promote(x, weight)").evaluate((x, w, None, 0)).dtype == torch.promote_types(xdt, w.dtype)
    # an optional argument under its `if`: its dtype when given, the first tensor's when not (the output is empty)
    r = rule("[bias[:]] dtype=promote(bias,float16) if bias")
    assert r.evaluate((x, w, b, 0)).dtype == torch.float64
    assert r.evaluate((x, w, None, 0)).dtype == torch.promote_types(xdt, torch.float16)


def test_like_keeps_dense_strides():
    x, w = torch.randn(5, 3).t(), torch.randn(7, 3)
    out = rule("like:x").evaluate((x, w, None, 0))
    assert out.shape == x.shape and out.stride() == x.stride()
    sliced = torch.randn(5, 6)[:, ::2]
    assert rule("like:x").evaluate((sliced, w, None, 0)).stride() == (3, 1)


def test_permutation_states_the_allocated_layout():
    schema = torch._C.parse_schema("att(Tensor q, Tensor v) -> Tensor")
    q, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 9, 3)  # (B, H, N, D), (B, H, S, Dv)
    out = rule("[q[0], q[2], q[1], v[-1]] perm=0,2,1,3", schema).evaluate((q, v))
    assert out.shape == (2, 4, 6, 3)
    assert out.stride() == torch.empty(2, 6, 4, 3).transpose(1, 2).stride()


@pytest.mark.parametrize(
    "args, empty",
    [
        ((2, True), False),
        ((2,), False),  # save_preact left out: its schema default, True
        ((0, True), True),  # no activation: nothing to save
        ((2, False), True),
    ],
)
def test_conditional_empty_output(args, empty):
    x, w = torch.randn(4, 5), torch.randn(7, 5)
    out = rule("[x[:-1], weight[0]] if activation and save_preact").evaluate((x, w, None, *args))
    assert out.shape == ((0,) if empty else (4, 7)) and out.dtype == x.dtype


def test_absent_optional_tensor_gives_an_empty_output():
    x, w, b = torch.randn(4, 5, dtype=torch.float64), torch.randn(7, 5), torch.randn(7, dtype=torch.float64)
    r = rule("[bias[:]] dtype=x if bias")
    assert r.evaluate((x, w, b, 0)).shape == (7,)
    out = r.evaluate((x, w, None, 0))
    assert out.shape == (0,) and out.dtype == torch.float64


@pytest.mark.parametrize("text", ["[bias[:]] dtype=bias if bias", "[bias[:]] if bias"])
def test_an_optional_tensor_gives_its_dtype_under_its_if(text):
    # the gradient of a Tensor? parameter: its own dtype when given (a float32 bias beside float64 x),
    # an empty tensor of the first tensor's dtype when not
    x, w, b = torch.randn(4, 5, dtype=torch.float64), torch.randn(7, 5), torch.randn(7)
    r = rule(text)
    given = r.evaluate((x, w, b, 0))
    assert given.shape == (7,) and given.dtype == torch.float32
    out = r.evaluate((x, w, None, 0))
    assert out.shape == (0,) and out.dtype == torch.float64


def test_too_few_dims_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"\[ns::op\] argument 'x' must have at least 3 dimensions .* got 2"):
        rule("[x[2]]").evaluate((torch.randn(2, 3), torch.randn(7, 3), None, 0))


def test_fake_outputs_equal_the_kernels_outputs():
    """What each rule says equals what the C allocates (shape, strides, dtype): the attention output's
    layout is stated in its descriptor beside the glue that allocates it, and this keeps the two equal."""
    x, w, b = torch.randn(4, 3, 5).transpose(0, 1), torch.randn(7, 5), torch.randn(7)
    q, k, v = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 4)
    samples = {
        "dispersion_correction": (x, 0.5),
        "matmul": (torch.randn(2, 4, 5), torch.randn(2, 5, 3)),
        "linear": (x, w, b, "gelu", True),
        "attention": (q, k, v, None, True, None),
        # the loss and the forward's gradients promote(hidden, float32), lse float32
        "linear_cross_entropy": (x[0].bfloat16(), w.bfloat16(), torch.tensor([1, 6, -100, 0]), b.bfloat16(), -100, 0.0,
                                 1, None, True),
        "linear_cross_entropy_none": (x[0].half(), w.half(), torch.tensor([1, 6, -100, 0]), None, -100, 0.0, None),
    }
    ops = {d.name: d for d in opforge.library.ops}
    for name, args in samples.items():
        real = getattr(torch.ops.opforge, name)(*args)
        real = real if isinstance(real, tuple) else (real,)
        for r, desc_rule in zip(real, ops[name].shape):
            f = desc_rule.evaluate(args)
            assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype), (name, str(desc_rule))


# ---- the evaluator on symbolic sizes ------------------------------------------------


def _symbolic(mode, *shapes):
    ctx = [StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(s)) for s in shapes]
    return [mode.from_tensor(torch.empty(s), symbolic_context=c) for s, c in zip(shapes, ctx)]


def test_symbolic_sizes_stay_symbolic_and_add_no_guards():
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    x, w = _symbolic(mode, (3, 4, 5), (7, 5))
    with mode:
        out = rule("[x[:-1], weight[0]] if activation and save_preact").evaluate((x, w, None, 1))
        lse = rule("[x[:2], 6] dtype=float32").evaluate((x, w, None, 1))
        perm = rule("[x[0], x[2], x[1]] perm=0,2,1").evaluate((x, w, None, 1))
        laid_out = x.new_empty((x.shape[0], x.shape[2], x.shape[1])).permute(0, 2, 1)
    assert all(isinstance(s, torch.SymInt) for s in out.shape)
    assert [str(s) for s in out.shape] == [str(x.shape[0]), str(x.shape[1]), str(w.shape[0])]
    assert [str(s) for s in lse.shape[:2]] == [str(s) for s in x.shape[:2]] and lse.shape[2] == 6
    assert [str(s) for s in perm.shape] == [str(s) for s in x.shape]
    assert [str(s) for s in perm.stride()] == [str(s) for s in laid_out.stride()]
    assert not env.guards  # evaluation never asked for an int


# ---- checks when a library loads ----------------------------------------------------


@pytest.mark.parametrize(
    "text, why",
    [
        ("lik:x", "starts with neither 'like:' nor a bracketed size list"),
        ("like:y", "no argument 'y' in the schema"),
        ("like:activation", "'activation' is int, not a Tensor"),
        ("[x[:-1], weigth[0]]", "no argument 'weigth'"),
        ("[x(0)]", "cannot read the size 'x\\(0\\)'"),
        ("[x[:]] dtype=float33", "no argument 'float33'"),
        ("[x[:]] perm=0,2", "not a permutation"),
        ("[x[0], x[1]] perm=0,1,2", "2 sizes for a permutation of 3"),
        ("[x[:]] when activation", "cannot read the options"),
        ("[bias[:]]", "'bias' may be None"),
        ("[bias[:]] dtype=bias", "'bias' may be None: read its sizes under 'if bias'"),
        ("[x[:]] dtype=bias", "dtype=bias: an optional argument may be None"),
        ("[x[:]] dtype=promote(x)", "promote takes two or more ARG\\|DTYPE items"),
        ("[x[:]] dtype=promote(x,float33)", "no argument 'float33'"),
        ("[x[:]] dtype=promote(x,bias)", "an optional argument may be None: take 'bias' under 'if bias'"),
        ("[x[:]] dtype=promote(x,float32", "cannot read the options"),
        ("[2, 3]", "give dtype="),
        ("like:x; like:x", "2 rule\\(s\\) for the schema's 1 output"),
        (None, "0 rule\\(s\\) for the schema's 1 output"),
    ],
)
def test_bad_rules_name_the_op_and_list_the_forms(text, why):
    with pytest.raises(RuntimeError, match=rf"\[ns::op\].*{why}.*Valid forms: like:ARG.*\[SIZES\]"):
        _shape.compile_rules("ns::op", SCHEMA, text)


BAD_LIBRARY = r"""
#include "opforge/op.h"

static void twice_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {}

OPF_OP_TABLE({.schema = "twice(Tensor x) -> Tensor", .cpu = twice_cpu, .shape = "like:x"},
             {.schema = "thrice(Tensor x) -> Tensor", .cpu = twice_cpu, .shape = "[x[:]] dtype=float31"})
"""


def test_a_bad_rule_fails_when_the_library_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "bad_shape.c"
    src.write_text(BAD_LIBRARY)
    with pytest.raises(RuntimeError, match=r"\[bad_shape::thrice\] bad shape rule .*'float31'.*Valid forms"):
        opforge.load("bad_shape", [str(src)])
    # checked before anything was registered: the namespace holds no op
    assert not hasattr(torch.ops.bad_shape, "twice")


def test_the_op_name_is_the_schemas():
    assert [d.name for d in opforge.library.ops] == [d.schema.partition("(")[0] for d in opforge.library.ops]
    assert "name" not in dict(_lib._Desc._fields_)


# ---- torch.compile(dynamic=True) across sizes -----------------------------------------


def _compiled(fn):
    counter = CompileCounterWithBackend("inductor")
    return torch.compile(fn, backend=counter, fullgraph=True, dynamic=True), counter


def _op_graphs(counter) -> int:
    # graphs holding opforge's ops: a fresh inductor cache may also compile an empty frame of its own
    return sum("torch.ops.opforge" in g.code for g in counter.graphs)


@pytest.mark.parametrize("bias, activation, grad", [(True, "gelu", True), (False, "none", True), (True, "relu", False)])
def test_compile_dynamic_linear(bias, activation, grad):
    w = torch.randn(12, 9, requires_grad=grad)
    b = torch.randn(12, requires_grad=grad) if bias else None
    act = {"gelu": F.gelu, "relu": F.relu, "none": lambda t: t}[activation]
    fn, counter = _compiled(lambda x: opforge.linear(x, w, b, activation) * 2)
    for lead in ((2, 5), (3, 7)):
        x = torch.randn(*lead, 9, requires_grad=grad)
        xr, wr = x.detach().clone().requires_grad_(grad), w.detach().clone().requires_grad_(grad)
        br = b.detach().clone().requires_grad_(grad) if bias else None
        y, ref = fn(x), act(F.linear(xr, wr, br)) * 2
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
        if grad:
            w.grad = None
            y.sum().backward()
            ref.sum().backward()
            torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(w.grad, wr.grad, rtol=1e-4, atol=1e-4)
    assert _op_graphs(counter) == 1  # the second size reused the symbolic graph


@pytest.mark.parametrize("batched", [False, True])
def test_compile_dynamic_matmul(batched):
    fn, counter = _compiled(lambda a, b: opforge.matmul(a, b) + 1)
    for m, k, n in ((5, 7, 3), (9, 4, 6)):
        lead = (2,) if batched else ()
        a, b = torch.randn(*lead, m, k, requires_grad=True), torch.randn(*lead, k, n, requires_grad=True)
        y = fn(a, b)
        torch.testing.assert_close(y, a.detach() @ b.detach() + 1, rtol=1e-4, atol=1e-4)
        y.sum().backward()
        torch.testing.assert_close(a.grad, torch.ones(*lead, m, n) @ b.detach().transpose(-1, -2), rtol=1e-4, atol=1e-4)
    assert _op_graphs(counter) == 1


@pytest.mark.parametrize("mask", [False, True])
def test_compile_dynamic_attention(mask):
    def block(q, k, v, m):
        # reading out through its (B, N, H*Dv) view depends on the layout the fake output states
        out = opforge.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=not mask)
        return out.transpose(1, 2).flatten(2) * 3

    fn, counter = _compiled(block)
    for n, s in ((6, 6), (11, 11)):
        q, k, v = (torch.randn(2, 3, length, 8, requires_grad=True) for length in (n, s, s))
        m = torch.rand(n, s) > 0.3 if mask else None
        if mask:
            m[:, 0] = True  # no fully masked row
        y = fn(q, k, v, m)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, attn_mask=m, is_causal=not mask).transpose(1, 2).flatten(2) * 3
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
        y.sum().backward()
        ref.sum().backward()
        for a, r in zip((q, k, v), leaves):
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-4, atol=1e-4)
    assert _op_graphs(counter) == 1
