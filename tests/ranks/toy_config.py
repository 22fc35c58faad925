"""The DeepSpeed config of an engine over the toy model (tests/ranks/toy.py) in the tests that compare ACCO's modes
with DeepSpeed's ZeRO-1."""

from __future__ import annotations

from tests.ranks import toy


def optimizer(mode: str, **params) -> dict:
    """The optimizer section: ``"zero1"``, DeepSpeed's own AdamW; else ACCO in ``mode``; ``params``: its settings."""
    if mode == "zero1":
        return {"type": "AdamW", "params": params}
    return {"type": "ACCO", "params": {**params, "mode": mode}}


def toy_config(optimizer: dict, gas: int, warmup: tuple | None = None, clip: float = 0.0, **sections) -> dict:
    """The toy's micro-batch, ``gas`` micro-batches a step, ``optimizer``, ZeRO stage 1, clipping ``clip``, no
    progress prints; ``warmup``: ``(min_lr, max_lr, steps)`` of a WarmupLR scheduler; ``sections``: the rest
    (``bf16``, ``fp16``, ...)."""
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": optimizer,
    }
    if warmup is not None:
        low, high, steps = warmup
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": low, "warmup_max_lr": high, "warmup_num_steps": steps},
        }
    return {
        **cfg,
        "zero_optimization": {"stage": 1},
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        **sections,
    }
