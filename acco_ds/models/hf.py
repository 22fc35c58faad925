"""GPT-2 and Llama decoders built from ``transformers`` configs (byte vocabulary, nothing downloaded).

Contract: ``build_hf(HFModelConfig(arch, ...))`` returns an ``HFCausalLM``, a ``transformers``
``GPT2LMHeadModel`` / ``LlamaForCausalLM`` made from a config (random initialisation, seeded by
the torch RNG: every rank that seeds alike builds the same parameters) behind the main job's call
contract: ``model(idx, targets)`` takes int64 token ids (B, T), T <= context, and returns the
mean next-token cross-entropy over all B*T positions (``targets`` are the next tokens, already
shifted, as ``acco_ds.data`` makes them); without targets it returns the logits (B, T, vocab).
Dropout is off and the KV cache is not kept (training).

``build_model(spec)`` / ``model_num_params(spec)`` take the model dict of a run
(``RunSpec.model``): ``{"arch": "tiny", ...GPTConfig fields}`` (or no ``arch``) is the built-in
``TinyGPT``; ``{"arch": "gpt2" | "llama", ...HFModelConfig fields}`` one of these. Parameter
counts are taken on the ``meta`` device (no memory). ``transformers`` is imported only when an HF
architecture is asked for; without it the error says how to install it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

ARCHS = ("gpt2", "llama")
ALL_ARCHS = ("tiny",) + ARCHS


@dataclass(frozen=True)
class HFModelConfig:
    """Size knobs of an HF decoder. ``d_ff`` 0: the architecture's default (GPT-2: 4 x d_model;
    Llama: 8/3 x d_model rounded up to a multiple of 64). ``n_kv_head`` (Llama) 0: n_head."""

    arch: str
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    context: int = 128
    d_ff: int = 0
    n_kv_head: int = 0
    vocab: int = 256

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"HFModelConfig.arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        for name in ("n_layer", "n_head", "d_model", "context", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"HFModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("d_ff", "n_kv_head"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"HFModelConfig.{name} must be >= 0 (0: the default), got {getattr(self, name)}"
                )
        if self.d_model % self.n_head:
            raise ValueError(
                f"HFModelConfig.d_model={self.d_model} must be divisible by n_head={self.n_head}; "
                "pick a d_model that is a multiple of n_head."
            )
        if self.arch == "gpt2" and self.n_kv_head:
            raise ValueError(
                "HFModelConfig.n_kv_head applies to llama only (GPT-2 has no grouped-query attention)"
            )
        if self.n_kv_head and self.n_head % self.n_kv_head:
            raise ValueError(
                f"HFModelConfig.n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}"
            )

    @property
    def ffn(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.arch == "gpt2":
            return 4 * self.d_model
        return -(-(8 * self.d_model) // 3 // 64) * 64

    def to_dict(self) -> dict:
        return asdict(self)


def _transformers():
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - the dev/hf extras install it
        raise ImportError(
            "the gpt2 and llama models need the transformers package: pip install 'acco_ds[hf]' "
            f"(or pip install transformers); import failed: {err}"
        ) from err
    return transformers


def transformers_config(cfg: HFModelConfig):
    """The ``transformers`` config object of ``cfg`` (no download: built from keywords)."""
    tf = _transformers()
    if cfg.arch == "gpt2":
        return tf.GPT2Config(
            vocab_size=cfg.vocab,
            n_positions=cfg.context,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_inner=cfg.ffn,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,
            eos_token_id=None,
            use_cache=False,
        )
    return tf.LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head or cfg.n_head,
        max_position_embeddings=cfg.context,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        use_cache=False,
    )


class HFCausalLM(nn.Module):
    """An HF causal LM behind ``model(idx, targets) -> loss`` (see the module docstring)."""

    def __init__(self, cfg: HFModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        tf = _transformers()
        self.cfg = cfg
        kwargs = {"dtype": dtype} if dtype is not None else {}
        self.lm = tf.AutoModelForCausalLM.from_config(transformers_config(cfg), **kwargs)

    def num_params(self) -> int:
        """Distinct parameters (tied ones counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if idx.size(1) > self.cfg.context:
            raise ValueError(f"sequence length {idx.size(1)} exceeds the model context {self.cfg.context}")
        logits = self.lm(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build_hf(cfg: HFModelConfig, dtype: torch.dtype | None = None) -> HFCausalLM:
    """A freshly initialised HF decoder (in ``dtype``, default the torch default dtype)."""
    return HFCausalLM(cfg, dtype)


def _split(spec: dict) -> tuple:
    spec = dict(spec)
    arch = spec.pop("arch", "tiny")
    if arch not in ALL_ARCHS:
        raise ValueError(f"model arch must be one of {', '.join(ALL_ARCHS)}, got {arch!r}")
    return arch, spec


def build_model(spec: dict, dtype: torch.dtype | None = None) -> nn.Module:
    """The model of a run's model dict (see the module docstring)."""
    arch, rest = _split(spec)
    if arch == "tiny":
        from acco_ds.models.gpt import GPTConfig, TinyGPT

        model = TinyGPT(GPTConfig(**rest))
        return model.to(dtype) if dtype is not None else model
    return build_hf(HFModelConfig(arch=arch, **rest), dtype)


def model_num_params(spec: dict) -> int:
    """Distinct parameters of ``build_model(spec)``, counted without allocating them."""
    with torch.device("meta"):
        return build_model(spec).num_params()
