"""opforge.patch_hf on small randomly initialised transformers models: the patched copy
gives the same logits, loss, gradients and generated tokens as the original."""

import copy
import sys

import pytest
import torch

import opforge

pytestmark = pytest.mark.slow  # the full tier: Hugging Face models, generation and training curves

transformers = pytest.importorskip("transformers")  # pinned in requirements-dev.txt: present in CI

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.0)


def _config(kind, **over):
    if kind == "gpt2":
        cfg = dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=128, attn_pdrop=0.0,
                   resid_pdrop=0.0, embd_pdrop=0.0)
    else:
        cfg = dict(COMMON)
        if kind == "qwen3":
            cfg["head_dim"] = 16
        if kind == "mistral":
            cfg["sliding_window"] = None
    cfg.update(over)
    return transformers.AutoConfig.for_model(kind, **cfg)


def _pair(kind, seed=0, **over):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, **over), attn_implementation="sdpa")
    patched = copy.deepcopy(model)
    report = opforge.patch_hf(patched)
    return model, patched, report


def _batch(seed, b=2, n=17):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 101, (b, n), generator=g)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gpt2"])
def test_patched_model_matches(kind):
    model, patched, report = _pair(kind)
    assert report.replaced and not report.left, str(report)
    assert list(model.state_dict()) == list(patched.state_dict())
    assert type(patched).__name__ == type(model).__name__  # save_pretrained records the same architecture
    ids = _batch(1)
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    labels = ids.clone()
    labels[0, :4] = -100
    out_p, out = patched(ids, labels=labels), model(ids, labels=labels)
    assert out_p.logits is None  # the logits are never built when training
    torch.testing.assert_close(out_p.loss, out.loss, atol=1e-5, rtol=1e-5)
    out_p.loss.backward()
    out.loss.backward()
    grads = dict(model.named_parameters())
    for name, p in patched.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generate_greedy_same_tokens(kind):
    model, patched, _ = _pair(kind, seed=1)
    model.eval()
    patched.eval()
    prompt = _batch(2, b=2, n=5)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(prompt, **kw), model.generate(prompt, **kw))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_left_padded_batch_same_tokens(cache):
    """Decoding steps run the attention op's few-query path with transformers' bool mask; a static
    cache hands over its whole length, cut to the keys attended (opforge.hf._attended_keys)."""
    model, patched, _ = _pair("llama", seed=3)
    model.eval()
    patched.eval()
    prompt = _batch(4, b=3, n=7)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding, as generate expects for decoder-only models
    mask[2, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    assert torch.equal(patched.generate(prompt, **kw), model.generate(prompt, **kw))


def test_attended_keys_cut_to_the_last_attended_key():
    from opforge.hf import _attended_keys

    k, v = torch.randn(2, 2, 50, 8), torch.randn(2, 2, 50, 8)
    mask = torch.zeros(2, 1, 3, 50, dtype=torch.bool)
    mask[0, 0, :, :20] = True
    mask[1, 0, 2, 5:31] = True
    k2, v2, m2 = _attended_keys(k, v, mask)
    assert k2.shape[2] == v2.shape[2] == m2.shape[-1] == 31
    assert k2.data_ptr() == k.data_ptr() and torch.equal(m2, mask[..., :31])  # views, not copies
    q = torch.randn(2, 2, 3, 8)
    torch.testing.assert_close(opforge.scaled_dot_product_attention(q, k2, v2, attn_mask=m2),
                               opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    nothing = torch.zeros_like(mask)
    assert _attended_keys(k, v, nothing)[0].shape[2] == 50  # no key attended anywhere: left as it is


def test_padded_batch_mask():
    model, patched, _ = _pair("llama", seed=2)
    ids = _batch(3, b=2, n=9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        got = patched(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], atol=1e-4, rtol=1e-4)


def _train(model, steps, dtype=None):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        ids = _batch(100 + step % 5)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


def test_llama_training_curves_match():
    model, patched, _ = _pair("llama", seed=3)
    lm, lp = _train(model, 50), _train(patched, 50)
    assert lm[-1] < 0.8 * lm[0]
    rel = ((lp - lm).abs() / lm).max().item()
    assert rel < 0.01, f"float32 loss curves differ by {rel:.4f} (relative) at worst"


def test_llama_training_curves_bfloat16_autocast():
    model, patched, _ = _pair("llama", seed=4)
    lm, lp = _train(model, 20, torch.bfloat16), _train(patched, 20, torch.bfloat16)
    rel = ((lp - lm).abs() / lm).max().item()
    assert rel < 0.05, f"bfloat16 autocast loss curves differ by {rel:.4f} (relative) at worst"


def test_unhonourable_configs_are_left_and_reported():
    _, patched, report = _pair("mistral", sliding_window=8)
    left = {name: why for name, _, why in report.left}
    assert any("sliding-window" in why for why in left.values()), str(report)
    assert patched.config._attn_implementation == "sdpa"
    _, _, report = _pair("llama", attention_dropout=0.1)
    assert any("dropout" in why for _, _, why in report.left)


def test_unknown_architecture_is_left():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "gpt_neox", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4))
    report = opforge.patch_hf(model)
    assert report.replaced == [] and "gpt_neox" in report.left[0][2]


def test_patches_the_instance_not_the_class():
    model, patched, _ = _pair("llama")
    assert type(model.model.layers[0].mlp) is not type(patched.model.layers[0].mlp)
    fresh = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    assert not hasattr(type(fresh.model.layers[0].mlp), "_opforge_original")


def test_without_transformers_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="opforge.patch_hf needs Hugging Face transformers"):
        opforge.patch_hf(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2"])
def test_patched_model_runs_opforge_ops(kind):
    _, patched, _ = _pair(kind)
    assert patched.config._attn_implementation == "opforge"
    ids = _batch(5)
    with torch.profiler.profile() as prof:
        patched(ids, labels=ids).loss.backward()
    names = {e.name for e in prof.events()}
    ns = opforge.namespace
    want = {"attention", "linear_cross_entropy"} | ({"layer_norm", "linear"} if kind == "gpt2" else
                                                     {"rms_norm", "rope", "glu"})
    missing = {op for op in want if f"{ns}::{op}" not in names}
    assert not missing, f"opforge ops not run: {missing}"


def test_projections_run_opforge_linear_unless_wrapped_or_hooked():
    """The attention and MLP projections of a patched model are opforge.linear (own kernels here: the op
    itself); a projection with a forward hook, or one that is not a plain nn.Linear, runs as the module."""
    saved = opforge.get_gemm()
    opforge.set_gemm("own")
    try:
        model, patched, _ = _pair("llama")
        layers = model.config.num_hidden_layers
        ids = _batch(6)
        with torch.profiler.profile() as prof:
            patched(ids, labels=ids)
        assert sum(e.name == f"{opforge.namespace}::linear" for e in prof.events()) == 7 * layers
        seen = []
        patched.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        lora = patched.model.layers[1].self_attn.q_proj = _Wrapped(patched.model.layers[1].self_attn.q_proj)
        with torch.profiler.profile() as prof:
            out = patched(ids, labels=ids)
        assert sum(e.name == f"{opforge.namespace}::linear" for e in prof.events()) == 7 * layers - 2
        assert seen == [(*ids.shape, model.config.hidden_size)] and lora.calls == 1
        model.model.layers[1].self_attn.q_proj = _Wrapped(model.model.layers[1].self_attn.q_proj)
        torch.testing.assert_close(out.loss, model(ids, labels=ids).loss, atol=1e-5, rtol=1e-5)
    finally:
        opforge.set_gemm(saved)


class _Wrapped(torch.nn.Module):
    """An adapter around a projection (as peft's LoRA layers are): not a plain nn.Linear."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x) * 1.5


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_output_attentions_per_call_gives_eager_weights(kind):
    """A model of eager attention asked for output_attentions=True in one call: the patched copy returns the
    weights eager attention makes (and the same logits), left padding included; without it, none are built."""
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager")
    patched = copy.deepcopy(model)
    opforge.patch_hf(patched)
    ids = _batch(5, b=2, n=9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask, output_attentions=True)
        got = patched(ids, attention_mask=mask, output_attentions=True)
        plain = patched(ids, attention_mask=mask)
    assert len(got.attentions) == len(want.attentions) == 2 and not plain.attentions
    for g, w in zip(got.attentions, want.attentions):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
