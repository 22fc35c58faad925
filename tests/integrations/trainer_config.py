"""The DeepSpeed config the Hugging Face Trainer tests hand the Trainer: every batch and clipping value "auto"
(filled from TrainingArguments), ZeRO stage 1, the optimizer given; ``AUTO``: AdamW's settings left to the
Trainer as well."""

from __future__ import annotations

AUTO = {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}


def trainer_ds_config(optimizer: dict, **extra) -> dict:
    """The config with ``optimizer`` (a DeepSpeed ``"optimizer"`` section) and any ``extra`` top-level keys."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": optimizer,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        **extra,
    }
