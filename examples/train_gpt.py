"""Train opforge's reference GPT on the project's README, byte by byte.

    python examples/train_gpt.py                 # opforge's ops
    python examples/train_gpt.py --plain         # the same model on torch's ops
    python examples/train_gpt.py --steps 20 --bf16

Prints the loss, tokens/s and the process's peak memory, with a progress bar,
and writes the loss curve to train_gpt_loss.png (or --png PATH).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from opforge.benchmark import Progress  # noqa: E402
from opforge.models import GPT, GPTConfig  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def corpus() -> torch.Tensor:
    with open(os.path.join(ROOT, "README.md"), "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.long)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--plain", action="store_true", help="torch's ops instead of opforge's")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument("--png", default="train_gpt_loss.png")
    a = p.parse_args(argv)

    data = corpus()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, dim=192, n_layers=4, n_heads=6, n_kv_heads=2, max_seq_len=a.seq)
    model = GPT(config, fused=not a.plain)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if a.bf16 else contextlib.nullcontext()
    g = torch.Generator().manual_seed(0)
    losses, tokens, t0 = [], 0, time.perf_counter()
    bar = Progress(a.steps, "train_gpt")
    for _ in range(a.steps):
        starts = torch.randint(0, len(data) - a.seq - 1, (a.batch,), generator=g)
        batch = torch.stack([data[s : s + a.seq + 1] for s in starts])
        with amp:
            _, loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        tokens += a.batch * a.seq
        bar.step(f"loss {losses[-1]:.3f}")
    dt = time.perf_counter() - t0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ops = "torch's" if a.plain else "opforge's"
    print(f"{ops} ops: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {a.steps} steps, {tokens / dt:,.0f} tokens/s, "
          f"peak RSS {peak_mib:,.0f} MiB ({torch.get_num_threads()} threads)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return losses
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(f"GPT on README.md bytes, {ops} ops")
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(f"loss curve: {a.png}")
    return losses


if __name__ == "__main__":
    main()
