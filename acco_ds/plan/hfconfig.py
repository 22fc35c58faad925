"""Parameter count of a model described by a ``transformers`` config, for ``acco-plan --model-config``.

Contract: ``count_params(source) -> ModelSize`` where ``source`` is a ``config.json`` file, a local
model folder holding one, or a model name already in the local Hugging Face cache (nothing is
downloaded). The model is instantiated on the ``meta`` device (no memory, no weights) with
``AutoModelForCausalLM`` (``AutoModel`` for architectures without a causal-LM head), so the count
is exact for any architecture ``transformers`` knows, tied embeddings counted once. Raises
``ValueError`` with a message saying what went wrong and what is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSize:
    params: int  # trainable parameters, each shared tensor once
    largest: int  # elements of the largest parameter tensor
    context: int | None  # max_position_embeddings / n_positions when the config has one
    model_type: str


def _load_config(source: str):
    try:
        from transformers import AutoConfig
    except ImportError as err:  # pragma: no cover - transformers is a dev/hf dependency
        raise ValueError("reading a model config needs transformers: pip install 'acco_ds[hf]'") from err
    p = Path(source)
    if p.is_file():
        try:
            raw = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{source}: not a readable JSON file ({err})") from err
        if not isinstance(raw, dict) or "model_type" not in raw:
            raise ValueError(f"{source}: not a transformers config (no 'model_type' key)")
        kind = raw.pop("model_type")
        try:
            return AutoConfig.for_model(kind, **raw)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from err
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{source}: a folder without a config.json")
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    if not source.endswith(".json") and not source.startswith(("/", ".", "~")):
        try:
            return AutoConfig.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"{source!r} is not a file or folder, nor a model in the local Hugging Face cache "
                "(acco-plan downloads nothing): give the path of a config.json or of a model folder"
            ) from err
    raise ValueError(f"{source}: no such file or folder (give a config.json or a model folder)")


def count_params(source: str) -> ModelSize:
    cfg = _load_config(source)
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            model = AutoModel.from_config(cfg)
    seen, total, largest = set(), 0, 0
    for prm in model.parameters():
        if id(prm) in seen or not prm.requires_grad:
            continue
        seen.add(id(prm))
        total += prm.numel()
        largest = max(largest, prm.numel())
    context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return ModelSize(total, largest, context, cfg.model_type)
