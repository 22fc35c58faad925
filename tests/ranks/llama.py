"""The tiny Llama of the Hugging Face and tensor-parallel rank scripts: built from a transformers config
(2 layers, hidden 32, MLP 64, 4 attention heads), no download, initialised from seed 0."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab: int, seq: int, kv_heads: int, tied: bool) -> LlamaForCausalLM:
    """A fresh model of ``vocab`` tokens and ``seq`` positions, ``kv_heads`` key/value heads, input and output
    embeddings tied when ``tied``; the same weights on every call (``torch.manual_seed(0)`` first)."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)
