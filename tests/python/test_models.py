"""opforge.models.GPT on torch's ops and on opforge's, and opforge.patch."""

import copy

import pytest
import torch

import opforge
from opforge.models import GPT, GPTConfig

SMALL = GPTConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def _batch(seed, b=3, n=33, vocab=SMALL.vocab_size):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (b, n + 1), generator=g)
    return idx[:, :-1], idx[:, 1:].contiguous()


def _pair(config=SMALL, seed=0):
    torch.manual_seed(seed)
    plain = GPT(config)
    fused = GPT(config, fused=True)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def test_same_parameter_names_and_state_dict():
    plain, fused = _pair()
    assert list(plain.state_dict()) == list(fused.state_dict())
    assert "layers.0.self_attn.q_proj.weight" in plain.state_dict()
    assert "layers.1.mlp.gate_proj.weight" in plain.state_dict()


def test_logits_loss_and_every_gradient_match():
    plain, fused = _pair()
    idx, tgt = _batch(1)
    tgt[0, :5] = -100  # ignored positions
    logits_p, loss_p = plain(idx, tgt)
    _, loss_f = fused(idx, tgt)
    with torch.no_grad():
        logits_f, none = fused(idx)
    assert none is None
    torch.testing.assert_close(logits_f, logits_p.detach(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(loss_f, loss_p, atol=1e-5, rtol=1e-5)
    loss_p.backward()
    loss_f.backward()
    grads_f = dict(fused.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads_f[name].grad, p.grad, atol=2e-5, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


def _train(model, steps, autocast_dtype=None):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        idx, tgt = _batch(100 + step % 7)  # a fixed synthetic corpus of 7 batches
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            _, loss = model(idx, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


@pytest.mark.slow
def test_training_curves_match_float32():
    plain, fused = _pair(seed=3)
    lp, lf = _train(plain, 50), _train(fused, 50)
    assert lp[-1] < 0.8 * lp[0]  # it learns
    rel = ((lf - lp).abs() / lp).max().item()
    assert rel < 0.01, f"float32 loss curves differ by {rel:.4f} (relative) at worst"


@pytest.mark.slow
def test_training_curves_match_bfloat16_autocast():
    plain, fused = _pair(seed=4)
    lp, lf = _train(plain, 30, torch.bfloat16), _train(fused, 30, torch.bfloat16)
    assert lp[-1] < 0.85 * lp[0]
    rel = ((lf - lp).abs() / lp).max().item()
    assert rel < 0.05, f"bfloat16 autocast loss curves differ by {rel:.4f} (relative) at worst"


def test_compile_fullgraph_matches_eager():
    _, fused = _pair(seed=5)
    idx, tgt = _batch(2)
    eager = fused(idx, tgt)[1]
    compiled = torch.compile(fused, fullgraph=True)(idx, tgt)[1]
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_sequence_too_long_is_refused():
    plain, _ = _pair()
    with pytest.raises(ValueError, match="max_seq_len"):
        plain(torch.zeros(1, SMALL.max_seq_len + 1, dtype=torch.long))


# ---- opforge.patch -------------------------------------------------------------------------------------


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = torch.nn.LayerNorm(32)
        self.rms = torch.nn.RMSNorm(32, eps=1e-5)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(64, 32))
        self.old_attn = torch.nn.MultiheadAttention(32, 4)  # batch_first=False: left, reported

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        x = self.rms(self.norm(x))
        return x + self.mlp(x)


def test_patch_swaps_in_place_and_matches():
    torch.manual_seed(0)
    model = _Toy()
    ref = copy.deepcopy(model)
    params_before = {id(p) for p in model.parameters()}
    report = opforge.patch(model)
    assert {id(p) for p in model.parameters()} == params_before  # the same Parameter objects
    replaced = {name: new for name, _, new in report.replaced}
    assert replaced == {"attn": "opforge.nn.MultiheadAttention", "norm": "opforge.nn.LayerNorm",
                        "rms": "opforge.nn.RMSNorm", "mlp.0": "opforge.nn.Linear('gelu_tanh')",
                        "mlp.2": "opforge.nn.Linear('none')"}
    left = {name: why for name, _, why in report.left}
    assert left == {"old_attn": "batch_first=False"}
    assert type(model.mlp[2]) is opforge.nn.Linear and model.mlp[2].activation == "none"
    assert isinstance(model.mlp[1], torch.nn.Identity)
    assert "replaced attn" in str(report)
    assert dict(report.notes)["attn"].startswith("fused where called with need_weights=False")
    # torch's default (need_weights=True) keeps returning torch's weights; False is the fused kernel's call
    x = torch.randn(2, 9, 32)
    for kw in ({}, dict(need_weights=True, average_attn_weights=False)):
        (out, w), (out_ref, w_ref) = model.attn(x, x, x, **kw), ref.attn(x, x, x, **kw)
        torch.testing.assert_close(out, out_ref, atol=0, rtol=0)
        torch.testing.assert_close(w, w_ref, atol=0, rtol=0)
    assert model.attn(x, x, x, need_weights=False)[1] is None

    x = torch.randn(2, 9, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, out_ref = model(x), ref(x2)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-4)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-4, rtol=1e-4)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if name.startswith("old_attn"):  # not used by forward: no gradient on either side
            assert p.grad is None and ref_params[name].grad is None
            continue
        torch.testing.assert_close(p.grad, ref_params[name].grad, atol=1e-4, rtol=1e-3)
    assert opforge.patch(model).replaced == []  # idempotent


def _op_calls(prof, op):
    name = f"{opforge.namespace}::{op}"
    return sum(e.name == name for e in prof.events())


@pytest.mark.parametrize("targets", [True, False])
def test_fused_projections_run_opforge_linear(targets):
    """Every projection of the fused model is opforge.linear (the faster GEMM per class of product: torch's
    bfloat16 GEMM is 20-30 times slower than opforge's on CPUs without native bfloat16), and so are the
    logits without targets; with own kernels each is the op itself."""
    saved = opforge.get_gemm()
    opforge.set_gemm("own")
    try:
        _, fused = _pair()
        idx, tgt = _batch(2)
        with torch.profiler.profile() as prof:
            fused(idx, tgt if targets else None)
        assert _op_calls(prof, "linear") == 7 * SMALL.n_layers + (0 if targets else 1)
        assert _op_calls(prof, "linear_cross_entropy") == (1 if targets else 0)
    finally:
        opforge.set_gemm(saved)


def test_patch_leaves_a_module_with_hooks():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    model[0].register_forward_hook(lambda m, i, o: None)
    model[1].register_forward_pre_hook(lambda m, i: None)
    report = opforge.patch(model)
    assert {name for name, _, _ in report.left} == {"0", "1"}
    assert all("forward hooks" in why for _, _, why in report.left)
    assert [name for name, _, _ in report.replaced] == ["2"]
    assert type(model[0]) is torch.nn.Linear and type(model[1]) is torch.nn.LayerNorm


def test_patched_plain_linear_off_the_cpu_is_torchs():
    """opforge's linear has CPU kernels only: a patched plain Linear on another device (meta here, as a
    model moved to the GPU) runs torch's F.linear, and the fused GPT's projections their modules."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 6))
    opforge.patch(model)
    model.to("meta")
    with torch.profiler.profile() as prof:
        out = model(torch.empty(3, 8, device="meta"))
    assert out.shape == (3, 6) and out.device.type == "meta"
    assert _op_calls(prof, "linear") == 0
    _, fused = _pair()
    x = torch.empty(2, 5, SMALL.dim, device="meta")
    with torch.profiler.profile() as prof:
        out = fused.to("meta").layers[0].mlp(x)
    assert out.shape == x.shape and _op_calls(prof, "linear") == 0
    # the rule sits in opforge.linear itself: a plain product off the CPU is F.linear's, an activation or
    # operands on two devices still reach the op (its fake kernel on meta; its error for mixed devices)
    w, b = torch.empty(6, 8, device="meta"), torch.empty(6, device="meta")
    with torch.profiler.profile() as prof:
        assert opforge.linear(torch.empty(3, 8, device="meta"), w, b).shape == (3, 6)
    assert _op_calls(prof, "linear") == 0
    with torch.profiler.profile() as prof:
        assert opforge.linear(torch.empty(3, 8, device="meta"), w, b, "gelu").shape == (3, 6)
    assert _op_calls(prof, "linear") == 1
    with pytest.raises(RuntimeError, match=r"argument 'weight' must be on the device of 'x' \(cpu\), got meta"):
        opforge.linear(torch.empty(3, 8), w, b)


def test_patch_refuses_a_bare_leaf():
    with pytest.raises(TypeError, match="patch the module that holds it"):
        opforge.patch(torch.nn.LayerNorm(8))


@pytest.mark.slow
def test_train_gpt_example_runs(tmp_path):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt.py")
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(["--steps", "4", "--batch", "2", "--seq", "32", "--png", str(tmp_path / "loss.png")])
    assert len(losses) == 4 and all(0 < v < 10 for v in losses)
    assert (tmp_path / "loss.png").exists()
