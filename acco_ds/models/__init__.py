"""Models of the main job: a tiny GPT-style byte-level decoder."""

from acco_ds.models.gpt import GPTConfig, TinyGPT

__all__ = ["GPTConfig", "TinyGPT"]
