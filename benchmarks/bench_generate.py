"""Greedy decoding with a Hugging Face Llama (random weights, built from a config), unpatched
(transformers' "sdpa" attention) against the same model after opforge.patch_hf: tokens per second of
the decoding steps, with transformers' dynamic cache and with its static (preallocated) cache, float32
(and bfloat16 on request). Both variants must produce the same tokens (checked).

The prompt is prefilled once per variant (its forward is timed on its own); each timed round then
decodes `new` tokens one at a time from a copy of the prefilled cache, as generate() does (the model's
forward with the cache, argmax), so that the steps are timed without the prefill. Rounds alternate
between the variants; medians.

    python benchmarks/bench_generate.py            # default: batch 4, prompt 1024, 32 new tokens, float32
    python benchmarks/bench_generate.py --smoke    # tiny, for CI
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import opforge  # noqa: E402
from opforge.benchmark import RESULTS, compare, write_results  # noqa: E402


def llama(smoke: bool, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    # vocab, hidden, MLP, layers, query heads, key/value heads; the default is a small model's layout
    # (Qwen2-0.5B: 14 query heads of 64, 2 key/value heads) at 4 layers
    sizes = (256, 64, 128, 1, 4, 2) if smoke else (8192, 896, 4864, 4, 14, 2)
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads")
    cfg = dict(zip(names, sizes))
    config = transformers.LlamaConfig(**cfg, max_position_embeddings=8192, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    model.config._attn_implementation = "sdpa"
    return model


def _prefill(model, prompt, cache_kind, max_len):
    """The prompt's forward into a new cache; returns (cache, the first new token)."""
    import transformers

    if cache_kind == "static":  # preallocated for twice what is used, as a server sizes it
        cache = transformers.StaticCache(config=model.config, max_cache_len=2 * max_len)
    else:
        cache = transformers.DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(prompt.shape[1]),
            logits_to_keep=1,
        )
    return cache, out.logits[:, -1].argmax(-1, keepdim=True)


def _decode(model, prefilled, prompt_len, new):
    """`new` greedy steps from a copy of the prefilled cache; the tokens (batch, new)."""
    cache, tok = copy.deepcopy(prefilled[0]), prefilled[1]
    batch = tok.shape[0]
    out = [tok]
    with torch.inference_mode():
        for i in range(new - 1):
            pos = prompt_len + i
            logits = model(
                input_ids=tok,
                attention_mask=torch.ones(batch, pos + 1, dtype=torch.long),
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.tensor([pos]),
                logits_to_keep=1,
            ).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out.append(tok)
    return torch.cat(out, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--batch", type=int, default=4, help="sequences generated together (default 4)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 1024; 16 with --smoke)")
    p.add_argument("--new", type=int, default=None, help="generated tokens (default 32; 4 with --smoke)")
    p.add_argument(
        "--dtypes",
        default=None,
        help="default float32 (bfloat16 too with --smoke): torch's bfloat16 "
        "matmuls are slow on CPUs without AVX512-BF16, and the prefill is most of the run",
    )
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    prompt_len = a.prompt or (16 if a.smoke else 1024)
    new = a.new or (4 if a.smoke else 32)
    reps = 3 if a.smoke else 5
    rows = []
    for dname in (a.dtypes or ("float32,bfloat16" if a.smoke else "float32")).split(","):
        dtype = getattr(torch, dname)
        models = {"hf": llama(a.smoke, dtype)}
        models["opforge"] = copy.deepcopy(models["hf"])
        opforge.patch_hf(models["opforge"])
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, models["hf"].config.vocab_size, (a.batch, prompt_len), generator=g)
        for cache_kind in ("dynamic", "static"):
            prefilled, fns, tokens = {}, {}, {}
            for name, m in models.items():
                cache, first = _prefill(m, prompt, cache_kind, prompt_len + new)
                prefilled[name] = (cache, first)
                fns[name] = functools.partial(_decode, m, prefilled[name], prompt_len, new)
                fns[f"{name}_prefill"] = functools.partial(_prefill, m, prompt, cache_kind, prompt_len + new)
                tokens[name] = fns[name]()
            same = torch.equal(tokens["hf"], tokens["opforge"])
            t = compare(fns, reps=reps, target_s=0.01)
            row = {
                "dtype": dname,
                "cache": cache_kind,
                "batch": a.batch,
                "prompt": prompt_len,
                "new": new,
                "hf_tok_s": a.batch * (new - 1) / t["hf"],
                "opforge_tok_s": a.batch * (new - 1) / t["opforge"],
                "decode_speedup": t["hf"] / t["opforge"],
                "prefill_speedup": t["hf_prefill"] / t["opforge_prefill"],
                "same_tokens": same,
            }
            rows.append(row)
            print(
                f"{dname} {cache_kind} cache, batch {a.batch}, prompt {prompt_len}: decoding {row['hf_tok_s']:.1f} -> "
                f"{row['opforge_tok_s']:.1f} tokens/s ({row['decode_speedup']:.2f}x), prefill "
                f"{row['prefill_speedup']:.2f}x, same tokens: {same}",
                flush=True,
            )
            if not same and dname == "float32":
                raise SystemExit("the patched model decoded other tokens than the original (float32)")
    table = write_results(
        "generate",
        rows,
        [
            f"ISA {opforge.get_isa()}, {torch.get_num_threads()} threads; a Llama of 4 layers, hidden 896, 14 query "
            "heads and 2 key/value heads of 64, MLP 4864, vocab 8192, random weights (--smoke: tiny)",
            "hf: transformers' sdpa attention; opforge: the same model after opforge.patch_hf; decoding tokens/s = "
            "batch x (new - 1) / time of the new - 1 decoding steps from a copy of the prefilled cache (the copy included, "
            "the same for both), medians of interleaved rounds; prefill: the prompt's forward into a new cache; "
            "static: transformers.StaticCache preallocated for 2 x (prompt + new) tokens",
            "same_tokens: the two greedy outputs are equal (bfloat16 may differ by rounding: reported, not required)",
        ],
        a.out,
    )
    print(table)


if __name__ == "__main__":
    main()
