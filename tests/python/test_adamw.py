"""opforge.optim.AdamW against torch.optim.AdamW: several steps against a float64 run of torch's
AdamW per dtype, torch's fused AdamW bit for bit (float32), maximize, weight decay 0 and > 0,
param groups with their own lr, parameters without gradients, dense non-contiguous layouts,
state_dict both ways, ISAs and thread counts (the same bits), and each error message."""

import copy

import pytest
import torch

import opforge
from opforge.optim import AdamW

OP = opforge.ops.adamw_step.default
QUAL = f"{opforge.namespace}::adamw_step"
SHAPES = [(), (0,), (1,), (7,), (16,), (17,), (33, 5), (123, 40), (4097,)]
# float32: a few roundings per step, accumulated over STEPS (the moments track torch's to ~1e-7)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
STEPS = 5


def make_params(dtype, shapes=SHAPES, layout=None):
    ps = []
    for s in shapes:
        p = torch.randn(s, dtype=torch.float64)
        if layout == "transposed" and p.dim() == 2:
            p = p.t().contiguous().t()  # dense, column-major
        ps.append(p.to(dtype).requires_grad_())
    return ps


def clone(ps, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in ps]


def run(opt, params, grads_per_step, cast=None):
    """grads_per_step[k][i]: parameter i's gradient at step k (None: none), given in the parameter's layout
    as autograd gives it."""
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = None if g is None else torch.empty_like(p).copy_(g if cast is None else cast(g))
        opt.step()


def grads_for(params, steps=STEPS, skip=()):
    return [[None if i in skip else torch.randn(p.shape, dtype=torch.float64) * 0.5 for i, p in enumerate(params)]
            for _ in range(steps)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hp", [dict(weight_decay=0.0), dict(weight_decay=0.1), dict(maximize=True),
                                dict(betas=(0.3, 0.9), eps=1e-4, weight_decay=0.5)], ids=str)
def test_steps_against_float64_torch(dtype, hp):
    params = make_params(dtype)
    ref = clone(params, torch.float64)
    grads = grads_for(params)
    kw = dict(lr=1e-2, **hp)
    run(AdamW(params, **kw), params, [[g.to(dtype) for g in gs] for gs in grads])
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    run(ref_opt, ref, [[g.to(dtype).double() for g in gs] for gs in grads])  # the gradients ours saw
    for i, (p, r) in enumerate(zip(params, ref)):
        assert p.dtype == dtype and p.shape == r.shape
        torch.testing.assert_close(p.double(), r.detach(), **TOL[dtype], msg=lambda m: f"param {i} {p.shape}: {m}")


def test_bfloat16_moments_are_float32_and_closer_than_torchs():
    """torch keeps a bfloat16 parameter's moments in bfloat16, where exp_avg_sq * 0.999 rounds back to
    itself; ours are float32: nearer the float64 run, and the parameters no further from it."""
    params = make_params(torch.bfloat16, [(4096,)])
    theirs, ref = clone(params), clone(params, torch.float64)
    grads = grads_for(params, steps=20)
    cast = [[g.bfloat16() for g in gs] for gs in grads]
    ours_opt, their_opt = AdamW(params, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    run(ours_opt, params, cast), run(their_opt, theirs, cast), run(ref_opt, ref, [[g.double() for g in gs] for gs in cast])
    ours_s, their_s, ref_s = ours_opt.state[params[0]], their_opt.state[theirs[0]], ref_opt.state[ref[0]]
    assert ours_s["exp_avg"].dtype == ours_s["exp_avg_sq"].dtype == torch.float32
    for k in ("exp_avg", "exp_avg_sq"):
        ours_err = (ours_s[k].double() - ref_s[k]).abs().max()
        their_err = (their_s[k].double() - ref_s[k]).abs().max()
        assert ours_err * 100 < their_err, (k, ours_err, their_err)
    err = lambda ps: (ps[0].detach().double() - ref[0].detach()).abs().max()  # noqa: E731
    assert err(params) <= err(theirs)


@pytest.mark.parametrize("layout", [None, "transposed"])
@pytest.mark.parametrize("hp", [dict(weight_decay=0.01), dict(weight_decay=0.0, maximize=True)], ids=str)
def test_float32_is_torchs_fused_adamw(hp, layout):
    """Bit for bit on the elements torch's fused kernel runs through its 16-lane loop (all but each
    tensor's last numel % 16); its scalar tail rounds exp_avg_sq with its own contraction: an ulp."""
    params = make_params(torch.float32, layout=layout)
    theirs = clone(params)
    grads = grads_for(params)
    run(AdamW(params, lr=1e-2, **hp), params, grads, cast=lambda g: g.float())
    their_opt = torch.optim.AdamW(theirs, lr=1e-2, fused=True, **hp)
    run(their_opt, theirs, grads, cast=lambda g: g.float())
    for p, t in zip(params, theirs):
        assert p.stride() == t.stride()
        a, b = p.detach().reshape(-1), t.detach().reshape(-1)
        body = a.numel() // 16 * 16
        assert torch.equal(a[:body], b[:body]), p.shape
        torch.testing.assert_close(a[body:], b[body:], rtol=1e-6, atol=1e-7)


def test_param_groups_own_lr_and_params_without_grad():
    params = make_params(torch.float32, [(10,), (20,), (30,), (5,)])
    ref = clone(params, torch.float64)
    groups = lambda ps: [{"params": ps[:2], "lr": 1e-1}, {"params": ps[2:], "lr": 1e-3, "weight_decay": 0.5}]  # noqa: E731
    grads = grads_for(params, skip={1, 3})
    opt = AdamW(groups(params), weight_decay=0.0)
    before = [p.detach().clone() for p in params]
    run(opt, params, grads, cast=lambda g: g.float())
    run(torch.optim.AdamW(groups(ref), weight_decay=0.0, foreach=False), ref, grads, cast=lambda g: g)
    for i in (0, 2):
        torch.testing.assert_close(params[i].double(), ref[i].detach(), **TOL[torch.float32])
    for i in (1, 3):  # never a gradient: untouched, and no state
        assert torch.equal(params[i].detach(), before[i]) and not opt.state[params[i]]
    assert opt.state[params[0]]["step"].item() == STEPS


def test_no_grad_at_all_is_a_no_op_and_closure_returns_the_loss():
    p = torch.ones(3, requires_grad=True)
    opt = AdamW([p])
    assert opt.step() is None and torch.equal(p.detach(), torch.ones(3))

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0 and not torch.equal(p.detach(), torch.ones(3))


def test_state_is_torchs():
    p = make_params(torch.bfloat16, [(4, 6)])[0]
    opt = AdamW([p])
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state[p]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["step"].dtype == torch.float32 and state["step"].dim() == 0 and state["step"].item() == 1
    assert state["exp_avg"].shape == p.shape and state["exp_avg"].dtype == torch.float32
    assert set(opt.param_groups[0]) == set(torch.optim.AdamW([p.detach().clone().requires_grad_()]).param_groups[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trips_through_torch(dtype):
    params = make_params(dtype, [(64,), (7, 9)])
    grads = grads_for(params, steps=6)
    cast = [[g.to(dtype) for g in gs] for gs in grads]
    ours = AdamW(params, lr=1e-2, weight_decay=0.1)
    run(ours, params, cast[:3])
    # ours -> torch's AdamW: it continues as ours does (in float32, the same bits; bfloat16 moments rounded)
    theirs_p = clone(params)
    theirs = torch.optim.AdamW(theirs_p, lr=0.5, fused=True)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # a state dict holds the optimizer's own tensors
    assert theirs.param_groups[0]["lr"] == 1e-2 and theirs.param_groups[0]["weight_decay"] == 0.1
    sd = copy.deepcopy(ours.state_dict())
    # torch -> ours: a fresh optimizer takes torch's state (bfloat16 moments widened) and continues
    back_p = clone(theirs_p)
    back = AdamW(back_p)
    back.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert all(back.state[p][k].dtype == torch.float32 for p in back_p for k in ("exp_avg", "exp_avg_sq"))
    run(ours, params, cast[3:]), run(theirs, theirs_p, cast[3:]), run(back, back_p, cast[3:])
    for a, b, c in zip(params, theirs_p, back_p):
        torch.testing.assert_close(a.double(), c.double(), **TOL[dtype])
        torch.testing.assert_close(a.double(), b.double(), **TOL[dtype])
    # ours -> ours keeps float32 moments exactly (torch's loader would round them to bfloat16)
    again = AdamW(clone(params))
    again.load_state_dict(sd)
    for i, p in enumerate(again.param_groups[0]["params"]):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert again.state[p][k].dtype == sd["state"][i][k].dtype
    assert torch.equal(again.state[again.param_groups[0]["params"][0]]["exp_avg"], sd["state"][0]["exp_avg"])


def test_thread_counts_give_the_same_bits():
    """Elementwise: any split of the tensors laid end to end gives the same bits. 70001 and 40000
    elements: tasks of the 32768-element grain start inside a tensor and span two."""
    ps0 = [make_params(dt, [(0,), (1,), (70001,), (17,), (40000,)]) for dt in (torch.float32, torch.bfloat16)]
    grads = [grads_for(ps, steps=3) for ps in ps0]
    results, before = {}, torch.get_num_threads()
    try:
        for n in (1, 2, 3, 16, 64):
            torch.set_num_threads(n)
            results[n] = []
            for ps, gs in zip(ps0, grads):
                ps = clone(ps)
                opt = AdamW(ps, weight_decay=0.1)
                run(opt, ps, gs)
                results[n] += [p.detach() for p in ps] + [opt.state[p][k] for p in ps for k in ("exp_avg", "exp_avg_sq")]
    finally:
        torch.set_num_threads(before)
    for n, res in results.items():
        assert all(torch.equal(a, b) for a, b in zip(res, results[1])), f"{n} threads differ from 1"


def test_isas_give_the_same_bits():
    ps0 = make_params(torch.float32, [(4097,), (33,)]) + make_params(torch.bfloat16, [(4097,), (33,)])
    grads = grads_for(ps0, steps=2)
    results = []
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            ps = clone(ps0)
            run(AdamW(ps, weight_decay=0.1), ps, grads)
            results.append((isa, [p.detach() for p in ps]))
    finally:
        opforge.set_isa("auto")
    for isa, res in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(res, results[0][1])), f"{isa} differs from {results[0][0]}"


def test_in_place_update_bumps_the_version_counter():
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3, requires_grad=True)
    loss = (w * x).sum()  # saves w for x's gradient
    w.grad = torch.ones(3)
    AdamW([w]).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ---- errors ------------------------------------------------------------------------------------------


def test_refuses_amsgrad_and_tensor_hyperparameters():
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        AdamW(p, amsgrad=True)
    with pytest.raises(ValueError, match="lr and betas must be floats"):
        AdamW(p, lr=torch.tensor(1e-3))
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        AdamW(p, betas=(0.9, 1.0))
    opt = AdamW(p)
    opt.param_groups[0]["amsgrad"] = True
    p[0].grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="amsgrad=True"):
        opt.step()
    for flag in ("capturable", "differentiable"):
        with pytest.raises(ValueError, match="capturable=True and differentiable=True are not supported"):
            AdamW(p, **{flag: True})


def test_takes_torchs_implementation_switches():
    """Code written for torch's AdamW(..., fused=True) or foreach=...: the same step (the switches pick among
    torch's kernels; this is one kernel whatever they say)."""
    steps = []
    for kw in ({}, dict(fused=True), dict(foreach=False), dict(fused=False, foreach=True)):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5, 3))
        opt = AdamW([p], lr=1e-2, **kw)
        for _ in range(3):
            p.grad = torch.randn(5, 3)
            opt.step()
        steps.append(p.detach().clone())
    assert all(torch.equal(s, steps[0]) for s in steps)


def test_refuses_sparse_gradients():
    p = torch.zeros(4, requires_grad=True)
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        AdamW([p]).step()


def step_error(params, grads=None):
    for p, g in zip(params, grads or [torch.ones_like(p) for p in params]):
        p.grad = g
    with pytest.raises(RuntimeError) as e:
        AdamW(params).step()
    return str(e.value).splitlines()[0]


def test_error_messages_name_the_op_and_the_argument():
    q = f"[{QUAL}]"
    assert step_error([torch.zeros(2, dtype=torch.float64, requires_grad=True)]) == (
        f"{q} argument 'params[0]' must be float32 or bfloat16, got float64")
    assert step_error([torch.zeros(2, requires_grad=True), torch.zeros(3, dtype=torch.float16, requires_grad=True)]) == (
        f"{q} argument 'params[1]' must be float32 or bfloat16, got float16")
    view = torch.zeros(4, 8)[:, ::2].requires_grad_()  # a leaf with gaps between its elements
    assert step_error([view], [torch.ones(4, 4)]) == (
        f"{q} argument 'params[0]' must be dense (contiguous in some order of its dims), got a view of sizes [4, 4]")
    t = torch.zeros(8, 4).t().requires_grad_()  # dense, transposed; its gradient row-major
    assert step_error([t], [torch.ones(4, 8)]) == (
        f"{q} argument 'grads[0]' must have the strides of 'params[0]' (dim 0: 1), got 8")


def op_error(*lists, hp=(1e-3, 0.9, 0.999, 1e-8, 0.0, False)):
    with pytest.raises(RuntimeError) as e:
        OP(*lists, *hp)
    return str(e.value).splitlines()[0]


def test_op_checks_its_lists():
    p, g, m, v, s = torch.zeros(3), torch.ones(3), torch.zeros(3), torch.zeros(3), torch.tensor(0.0)
    q = f"[{QUAL}]"
    assert op_error([p], [g], [m], [v], []) == f"{q} argument 'steps' must hold one tensor per parameter (1), got 0"
    assert op_error([p], [g, g], [m], [v], [s]) == f"{q} argument 'grads' must hold one tensor per parameter (1), got 2"
    assert op_error([p], [g.bfloat16()], [m], [v], [s]) == (
        f"{q} argument 'grads[0]' must have the dtype of 'params[0]' (float32), got bfloat16")
    assert op_error([p], [g], [m.bfloat16()], [v], [s]) == f"{q} argument 'exp_avgs[0]' must be float32, got bfloat16"
    assert op_error([p], [g], [m], [torch.zeros(4)], [s]) == (
        f"{q} argument 'exp_avg_sqs[0]' must have the shape of 'params[0]' [3], got [4]")
    assert op_error([p], [g], [m], [v], [torch.zeros(2)]) == (
        f"{q} argument 'steps[0]' must hold one value (the step count), got 2")
    assert op_error([p], [g], [m], [v], [torch.tensor(0)]) == f"{q} argument 'steps[0]' must be float32 or float64, got int64"
    assert torch.equal(p, torch.zeros(3)) and s.item() == 0  # nothing ran


def test_op_on_empty_tensors():
    e, s = torch.zeros(0), torch.tensor(0.0, dtype=torch.float64)
    OP([e], [e], [e.clone()], [e.clone()], [s], 1e-3, 0.9, 0.999, 1e-8, 0.0, False)
    assert s.item() == 1.0
