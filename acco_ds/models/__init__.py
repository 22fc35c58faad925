"""Models of the main job: a tiny GPT-style byte-level decoder, and GPT-2 / Llama decoders built from
``transformers`` configs (``acco_ds.models.hf``; transformers is imported only when one is built)."""

from acco_ds.models.gpt import GPTConfig, TinyGPT
from acco_ds.models.hf import ALL_ARCHS, HFCausalLM, HFModelConfig, build_hf, build_model, model_num_params

__all__ = [
    "ALL_ARCHS",
    "GPTConfig",
    "HFCausalLM",
    "HFModelConfig",
    "TinyGPT",
    "build_hf",
    "build_model",
    "model_num_params",
]
