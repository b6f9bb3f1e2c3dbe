"""The brief's Transformer table: time per training step and peak memory of
the attention layer alone, the MLP block alone and the whole model
(opforge.models.GPT), and a Hugging Face Llama of the same size unpatched vs
opforge.patch_hf, native eager vs native torch.compile vs opforge, in float32
and under bfloat16 autocast.

A step is forward, backward and an AdamW update (torch.optim.AdamW(fused=True), torch's fastest on
CPU, for eager and compile; opforge.optim.AdamW for opforge unless --torch-adamw). Each component is checked
against eager before it is timed; variants are timed interleaved in one
process (medians) and their peak memory is read the same way for each (the
allocator's high-water mark during one step, above what was held before).

    python benchmarks/bench_transformer.py            # default shape: minutes
    python benchmarks/bench_transformer.py --full     # the brief's batch 32 x sequence 512 (long)
    python benchmarks/bench_transformer.py --smoke    # tiny, for CI
    python benchmarks/bench_transformer.py --malloc keep   # freed memory kept for reuse (no fresh pages)

Page faults per step are counted for each variant: under glibc's default
malloc a tensor above its mmap threshold (which rises with use, to 32 MiB at
most: eager's logits and their gradient stay above it) is mapped fresh, and
paged in, every step. --malloc keep measures without that cost, as a process
with jemalloc or tcmalloc would run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import opforge  # noqa: E402
from opforge.benchmark import (  # noqa: E402
    MALLOC_MODES,
    RESULTS,
    Progress,
    compare,
    malloc_note,
    malloc_suffix,
    page_faults,
    peak_memory,
    set_malloc,
    write_results,
)
from opforge.models import GPT, GPTConfig  # noqa: E402
from opforge.models.gpt import MLP, Attention  # noqa: E402

SHAPES = {  # (batch, sequence, config)
    "smoke": (2, 32, GPTConfig(vocab_size=256, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)),
    "default": (8, 256, GPTConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8, n_kv_heads=2, max_seq_len=256)),
    "full": (32, 512, GPTConfig(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, max_seq_len=512)),
}


class _Rope(torch.nn.Module):
    """A component with its rotary tables, called as the model calls it."""

    def __init__(self, inner: torch.nn.Module, cos, sin):
        super().__init__()
        self.inner, self.cos, self.sin = inner, cos, sin

    def forward(self, x):
        return self.inner(x, self.cos, self.sin)


def components(batch: int, seq: int, c: GPTConfig, seed: int = 0):
    """name -> (plain module, inputs, loss of the output): the plain module's copy is the fused one."""
    torch.manual_seed(seed)
    model = GPT(c)
    x = torch.randn(batch, seq, c.dim) * 0.5
    idx = torch.randint(0, c.vocab_size, (batch, seq + 1))
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    return {
        "attention layer": (_Rope(Attention(c), cos, sin), (x,), lambda out, *_: out.float().square().mean()),
        "MLP block": (MLP(c), (x,), lambda out, *_: out.float().square().mean()),
        "whole model": (model, (idx[:, :-1], idx[:, 1:]), lambda out, *_: out[1]),
    }


def hf_llama(batch: int, seq: int, c: GPTConfig, seed: int = 0):
    """A Hugging Face Llama of the GPT's size (random weights), or None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.hidden_dim,
                                      num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                                      num_key_value_heads=c.n_kv_heads, max_position_embeddings=c.max_seq_len,
                                      tie_word_embeddings=True, rms_norm_eps=c.norm_eps)
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, c.vocab_size, (batch, seq))
    return model, (ids,), lambda out, *_: out.loss


class _WithLabels(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, labels=ids)


def _set_fused(m: torch.nn.Module, fused: bool):
    for sub in m.modules():
        if hasattr(sub, "fused"):
            sub.fused = fused
    return m


def variants(plain: torch.nn.Module):
    if isinstance(plain, _WithLabels):  # a transformers model: opforge = the same model patched
        fused = copy.deepcopy(plain)
        opforge.patch_hf(fused.model)
    else:
        fused = _set_fused(copy.deepcopy(plain), True)
    return {"eager": plain, "compile": torch.compile(copy.deepcopy(plain)), "opforge": fused}


def step_fn(module, inputs, loss_of, dtype, opforge_adamw=False):
    """One training step; the update is torch's fastest AdamW on CPU (fused=True), or with opforge_adamw
    opforge.optim.AdamW (the opforge side's, unless --torch-adamw)."""
    if opforge_adamw:
        opt = opforge.optim.AdamW(module.parameters(), lr=1e-4)
    else:
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
    amp = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()

    def step():
        with amp:
            loss = loss_of(module(*inputs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--full", action="store_true", help="the brief's shape: batch 32 x sequence 512")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--reps", type=int, default=None, help="timed rounds per variant (default 5; 3 with --smoke)")
    p.add_argument("--profile", action="store_true",
                   help="instead of timing: torch.profiler tables by op of two steps of each component, eager and "
                        "opforge, in <out>/transformer_<shape>_profile.txt (where the time goes)")
    p.add_argument("--torch-adamw", action="store_true",
                   help="the opforge side updates with torch.optim.AdamW(fused=True) as the baselines do, not with "
                        "opforge.optim.AdamW")
    p.add_argument("--malloc", choices=MALLOC_MODES, default="default",
                   help="keep: glibc keeps freed memory for reuse, for every variant (opforge.benchmark.set_malloc); "
                        "results then go to transformer_<shape>_malloc_keep")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    set_malloc(a.malloc)
    shape = "smoke" if a.smoke else "full" if a.full else "default"
    batch, seq, config = SHAPES[shape]
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    reps, target = (3, 0.01) if a.smoke else (5, 0.5)
    reps = a.reps or reps
    comps = components(batch, seq, config)
    llama = hf_llama(batch, seq, config)
    if llama is not None:
        comps["HF Llama (patch_hf)"] = (_WithLabels(llama[0]), llama[1], llama[2])
    if a.profile:
        return _profile(comps, dtypes, f"transformer_{shape}_profile.txt", a.out, not a.torch_adamw)
    progress = Progress(len(dtypes) * len(comps), "bench_transformer")
    rows = []
    for dtype in dtypes:
        for name, (plain, inputs, loss_of) in comps.items():
            progress.step(f"{name} {str(dtype)[6:]}")
            mods = variants(plain)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):  # check before timing
                want = loss_of(mods["eager"](*inputs)).float()
                got = loss_of(mods["opforge"](*inputs)).float()
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            steps = {v: step_fn(m, inputs, loss_of, dtype, v == "opforge" and not a.torch_adamw) for v, m in mods.items()}
            t = compare(steps, reps=reps, target_s=target)
            mem = {v: peak_memory(s) for v, s in steps.items()}
            faults = {v: page_faults(s) for v, s in steps.items()}
            rows.append({
                "component": name, "dtype": str(dtype)[6:],
                "eager_ms": 1e3 * t["eager"], "compile_ms": 1e3 * t["compile"], "opforge_ms": 1e3 * t["opforge"],
                "speedup_vs_eager": t["eager"] / t["opforge"], "speedup_vs_compile": t["compile"] / t["opforge"],
                "mem_saved_vs_eager_pct": 100 * (1 - mem["opforge"] / mem["eager"]) if mem["eager"] else 0.0,
                "mem_saved_vs_compile_pct": 100 * (1 - mem["opforge"] / mem["compile"]) if mem["compile"] else 0.0,
                "peak_MiB_eager": mem["eager"] / 2**20, "peak_MiB_opforge": mem["opforge"] / 2**20,
                "faults_eager": faults["eager"], "faults_compile": faults["compile"],
                "faults_opforge": faults["opforge"],
            })
            r = rows[-1]
            print(f"\n{name} {r['dtype']}: {r['speedup_vs_eager']:.2f}x eager, {r['speedup_vs_compile']:.2f}x compile, "
                  f"{r['mem_saved_vs_eager_pct']:.0f}% less peak memory than eager", file=sys.stderr, flush=True)
    c = config
    stem = f"transformer_{shape}" if len(dtypes) == 2 else f"transformer_{shape}_{a.dtypes}"  # one dtype: its own file
    stem += malloc_suffix(a.malloc)
    table = write_results(stem, rows, [
        f"shape: batch {batch} x sequence {seq}; GPT dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads "
        f"({c.n_kv_heads} key/value heads), MLP {c.hidden_dim}, vocab {c.vocab_size}",
        "a step = forward + backward + AdamW; bfloat16 = torch.autocast('cpu', bfloat16) over float32 weights",
        "AdamW: torch.optim.AdamW(fused=True) for eager and compile; "
        + ("the same for opforge (--torch-adamw)" if a.torch_adamw else "opforge.optim.AdamW for opforge"),
        "eager = the same modules on torch's ops; compile = torch.compile of them; opforge = the same parameters on "
        "opforge's ops (rms_norm/add_rms_norm, rope, attention, swiglu, linear_cross_entropy); HF Llama: a "
        "transformers LlamaForCausalLM of the same size, eager = unpatched (sdpa), opforge = opforge.patch_hf",
        "peak memory: allocator high-water mark during one step above what was held before it, the same way for "
        "every variant",
        "faults_*: minor page faults per step (median of 3): memory paged in fresh, the C allocator's cost, "
        "not the ops' work",
        malloc_note(a.malloc),
    ], a.out)
    _plot(rows, stem, a.out)
    print(table)


def _profile(comps, dtypes, name, out_dir, opforge_adamw):
    """Two steps of each component (after two warm-up steps), eager then opforge, as torch.profiler tables
    sorted by self CPU time."""
    parts = [f"# torch.profiler, two training steps (forward, backward, AdamW) per component and variant, "
             f"sorted by self CPU time; torch {torch.__version__}, ISA {opforge.get_isa()}, "
             f"{torch.get_num_threads()} threads"]
    for dtype in dtypes:
        for cname, (plain, inputs, loss_of) in comps.items():
            mods = variants(plain)
            for v in ("eager", "opforge"):
                step = step_fn(mods[v], inputs, loss_of, dtype, v == "opforge" and opforge_adamw)
                step(), step()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    step(), step()
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48)
                parts.append(f"\n## {cname}, {str(dtype)[6:]}, {v}\n{table}")
                print(parts[-1], flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        f.write("\n".join(parts) + "\n")


def _plot(rows, stem, out_dir):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['component']}\n{r['dtype']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["speedup_vs_eager"] for r in rows], 0.4, label="vs eager")
    ax.bar([x + 0.2 for x in xs], [r["speedup_vs_compile"] for r in rows], 0.4, label="vs torch.compile")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("training-step speed-up (x)")
    ax.set_title(f"opforge Transformer components ({stem})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{stem}.png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
