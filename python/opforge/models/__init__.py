"""Models built on opforge's ops: a reference decoder-only Transformer."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
