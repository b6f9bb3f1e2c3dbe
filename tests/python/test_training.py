"""Training with opforge's ops: autocast (bfloat16 and float16, GradScaler), activation checkpointing,
whole-model torch.compile, and determinism.

Every op as a user calls it -- an input builder and the torch function it stands for -- is a
training.Case in the TRAINING table of the op's test module (tests/python/discover.py), and each
section runs every case: the autocast tests compare the dtypes (and values) of every op with its torch
twin's under torch.autocast, the checkpoint tests recompute every op, the determinism tests run every
op's forward and backward at 1 and 2 threads. test_every_op_has_a_case_and_a_policy fails when the
library has an op no case runs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import discover
import opforge
from opforge import _lib
from opforge.models import GPT, GPTConfig
from opforge.models.gpt import Block

NONE = _lib.AUTOCAST_NONE

# ---- the cases --------------------------------------------------------------------------------------

CASES = discover.entries("TRAINING")

# Each forward op's autocast policy (its descriptor's .autocast, plus what its Python wrapper adapts; a
# case states its ops' policy) and the torch function whose dtype it returns under
# torch.autocast("cpu", bfloat16 / float16):
#   lower    floating inputs cast to the autocast dtype   F.linear, torch.matmul, F.scaled_dot_product_attention
#   fp32     floating inputs cast to float32               F.cross_entropy (torch's CPU fp32 list)
#   promote  cast to the widest floating input             eager elementwise ops (x * a + sqrt(x), silu(g) * u,
#                                                          q * cos + rotate_half(q) * sin): on no autocast list
#   none     the dtype given                               F.softmax, F.log_softmax: on no CPU autocast list
#   follow   float32 parameters cast to a 16-bit first     F.rms_norm, F.layer_norm
#            input's dtype


def _forward_ops():
    forward = set(discover.forward_ops())
    return {d.name: d for d in opforge.library.ops if d.name in forward}


def test_every_op_has_a_case_and_a_policy():
    msg = discover.coverage("TRAINING", {name for case in CASES.values() for name in case.ops})
    assert msg is None, msg
    ops = _forward_ops()
    for label, case in CASES.items():
        want = getattr(_lib, f"AUTOCAST_{case.autocast.upper()}")
        for name in case.ops:
            assert ops[name].autocast == want, \
                f"{label}: {name}'s descriptor has autocast {ops[name].autocast}, the case says {case.autocast} ({want})"


def _outs(y):
    return tuple(y) if isinstance(y, (tuple, list)) else (y,)


def _leaves(args, grads, requires_grad=True):
    return [a.detach().clone().requires_grad_(requires_grad and i in grads) if isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)]


def _upstream(outs, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]


# ---- 1. autocast -----------------------------------------------------------------------------------

# values under autocast, opforge vs torch's twin under the same autocast: max |a - b| <= TOL * (max |b| + 1)
AUTOCAST_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _assert_near(got, want, tol, what):
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    bound = tol * (want.double().abs().max().item() + 1 if want.numel() else 1)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("given", ["float32", "amp"])
@pytest.mark.parametrize("name", list(CASES))
def test_autocast_dtype_and_gradients_as_torch(name, given, amp):
    """Every op under torch.autocast("cpu") returns the dtype its torch twin returns, with values close to
    the twin's, and the gradients of its inputs come back in their own dtype."""
    case = CASES[name]
    args = case.make(torch.float32 if given == "float32" else amp, False)
    mine, theirs = _leaves(args, case.grads), _leaves(args, case.grads)
    with torch.autocast("cpu", dtype=amp):
        got, want = _outs(case.opforge(*mine)), _outs(case.torch(*theirs))
    assert [o.dtype for o in got] == [o.dtype for o in want], f"{name}: dtypes differ from torch's under autocast"
    tol = AUTOCAST_TOL[amp]
    for i, (a, b) in enumerate(zip(got, want)):
        _assert_near(a, b, tol, f"{name} output {i}")
    ups = _upstream(got)
    if case.grads:  # an op with no derivative (inference) has only its values to compare
        torch.autograd.backward(got, ups)
        torch.autograd.backward(want, ups)
    for i in case.grads:
        assert mine[i].grad.dtype == mine[i].dtype, f"{name}: gradient of argument {i} in {mine[i].grad.dtype}"
        _assert_near(mine[i].grad, theirs[i].grad, 2 * tol, f"{name} gradient of argument {i}")


def test_autocast_kernels_registered_for_cpu_and_cuda():
    # each device type's policy is registered (nothing CUDA runs here: only the registration is checked)
    for name, d in _forward_ops().items():
        for key, device in (("AutocastCPU", "cpu"), ("AutocastCUDA", "cuda")):
            has = torch._C._dispatch_has_kernel_for_dispatch_key(f"{opforge.namespace}::{name}", key)
            assert has == (d.autocast_on(device) != NONE), f"{name}: {key} kernel {'missing' if not has else 'unexpected'}"


SMALL = GPTConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def _batch(seed, b=2, n=32, vocab=SMALL.vocab_size):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (b, n + 1), generator=g)
    return idx[:, :-1], idx[:, 1:].contiguous()


def _pair(seed):
    torch.manual_seed(seed)
    plain = GPT(SMALL)
    fused = GPT(SMALL, fused=True)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def test_grad_scaler_float16_trains_as_torch():
    """A fused GPT (opforge's norms, rope, attention, swiglu, linear cross-entropy) trained under float16
    autocast with GradScaler beside the same model on torch's ops: the same scale (no step skipped on
    either side), finite float32 losses, parameters moved and close to the twin's."""
    plain, fused = _pair(seed=11)
    start = copy.deepcopy(fused.state_dict())
    runs = {}
    for label, model in (("torch", plain), ("opforge", fused)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        losses, scales = [], []
        for step in range(4):
            idx, tgt = _batch(50 + step)
            with torch.autocast("cpu", dtype=torch.float16):
                _, loss = model(idx, tgt)
            assert loss.dtype == torch.float32, f"{label}: loss in {loss.dtype} under float16 autocast"
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
        runs[label] = losses, scales
    (lt, st), (lo, so) = runs["torch"], runs["opforge"]
    assert all(torch.isfinite(torch.tensor(lo)))
    assert so == st == [65536.0] * 4, (so, st)  # no overflow, so no skipped step and no back-off, on both
    torch.testing.assert_close(torch.tensor(lo), torch.tensor(lt), atol=2e-3, rtol=1e-3)
    theirs = dict(plain.named_parameters())
    for name, p in fused.named_parameters():
        assert not torch.equal(p, start[name]), f"{name} was not updated"
        torch.testing.assert_close(p, theirs[name], atol=5e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


def test_grad_scaler_skips_an_overflowing_step():
    """An inf in float16 gradients (a scale too large for float16) is found by the scaler: the step is
    skipped, the parameters are left as they were and the scale backs off."""
    _, fused = _pair(seed=12)
    before = copy.deepcopy(fused.state_dict())
    opt = torch.optim.SGD(fused.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    idx, tgt = _batch(3)
    with torch.autocast("cpu", dtype=torch.float16):
        _, loss = fused(idx, tgt)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**39
    for name, p in fused.named_parameters():
        assert torch.equal(p, before[name]), f"{name} changed in a skipped step"


# ---- 4. checkpointing and compile -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_checkpoint_gives_the_same_gradients(name):
    """torch.utils.checkpoint (non-reentrant) around each op: the recomputed forward is the same C on the
    same inputs, so outputs and gradients are bitwise the ones without checkpointing."""
    case = CASES[name]
    args = case.make(torch.float32, False)
    plain, ckpt = _leaves(args, case.grads), _leaves(args, case.grads)
    want = _outs(case.opforge(*plain))
    got = _outs(checkpoint(case.opforge, *ckpt, use_reentrant=False))
    ups = _upstream(want)
    if case.grads:
        torch.autograd.backward(want, ups)
        torch.autograd.backward(got, ups)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for i in case.grads:
        assert torch.equal(ckpt[i].grad, plain[i].grad), f"{name}: gradient of argument {i} differs"


class _Checkpointed(torch.nn.Module):
    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16_autocast"])
def test_checkpointed_blocks_give_bitwise_the_same_gradients(amp):
    """Every Block of a fused GPT (add_rms_norm, rope, attention, swiglu) wrapped in checkpoint: the loss
    (linear_cross_entropy) and every parameter's gradient are bitwise those of the model without it."""
    _, model = _pair(seed=13)
    ckpt = copy.deepcopy(model)
    for i, block in enumerate(ckpt.layers):
        ckpt.layers[i] = _Checkpointed(block)
    idx, tgt = _batch(4)
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        loss = model(idx, tgt)[1]
        loss_ckpt = ckpt(idx, tgt)[1]
    loss.backward()
    loss_ckpt.backward()
    assert torch.equal(loss, loss_ckpt)
    grads = {n.replace(".block.", "."): p.grad for n, p in ckpt.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), f"{name}: gradient differs under checkpointing"


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [(24, 30), (33, 37)], ids=["tokens-le-hidden", "tokens-gt-hidden"])
def test_compile_whole_model_dynamic_two_lengths_no_recompile(lengths):
    """torch.compile(fused GPT, fullgraph=True, dynamic=True): one graph (fullgraph raises on a break), a
    second sequence length runs the same compiled code (set_stance('fail_on_recompile') raises otherwise),
    and the loss and every gradient match eager at both lengths. Both lengths on one side of the loss head's
    path rule (linear_cross_entropy keeps the logits' gradient for tokens <= hidden, 2 x 32 = 64 here: a
    guard, so that a length across it compiles a second graph), each side tested. The static compile of the
    forward is test_models.py's."""
    _, eager = _pair(seed=14)
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the session's earlier compiles count there too
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for n, seed, stance in ((lengths[0], 5, "default"), (lengths[1], 6, "fail_on_recompile")):
        idx, tgt = _batch(seed, n=n)
        want = eager(idx, tgt)[1]
        eager.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.compiler.set_stance(stance):
            got = compiled(idx, tgt)[1]
            got.backward()
        want.backward()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        theirs = dict(eager.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, theirs[name].grad, atol=1e-5, rtol=1e-4,
                                       msg=lambda m, k=name, n=n: f"length {n}, {k}: {m}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()


# ---- 6. determinism --------------------------------------------------------------------------------


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for the test; the flag and the thread count restored after."""
    flag, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(flag, warn_only=warn_only)
        torch.set_num_threads(threads)


def _run(case, args):
    leaves = _leaves(args, case.grads)
    outs = _outs(case.opforge(*leaves))
    if case.grads:
        torch.autograd.backward(outs, _upstream(outs))
    return [o.detach() for o in outs] + [leaves[i].grad for i in case.grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_deterministic_across_runs_and_thread_counts(name, dtype, deterministic):
    """Under torch.use_deterministic_algorithms(True) every op's outputs and gradients are bitwise the same
    on two runs and at 1 and 2 threads (sizes spanning several row blocks: the weight gradients' sums over
    rows, attention's key/value gradients, the losses' reductions)."""
    case = CASES[name]
    args = case.make(dtype, True)
    torch.set_num_threads(2)
    first = _run(case, args)
    again = _run(case, args)
    torch.set_num_threads(1)
    single = _run(case, args)
    for i, (a, b, c) in enumerate(zip(first, again, single)):
        assert torch.equal(a, b), f"{name}: result {i} differs between two runs at 2 threads"
        assert torch.equal(a, c), f"{name}: result {i} differs between 1 and 2 threads"
