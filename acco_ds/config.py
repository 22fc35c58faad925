"""ACCOConfig: the options of ``"optimizer": {"type": "ACCO", "params": {...}}``.

Every field is validated with a message that names the key, the value seen and what is allowed;
unknown keys are an error. The model knows nothing of DeepSpeed: the checks that need the rest of
the DeepSpeed config (ZeRO stage, gradient_accumulation_steps, ...) live in
``acco_ds.deepspeed.validate``.
"""

from __future__ import annotations

from typing import Literal, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MODES = ("acco", "dpu", "sync")
ACCUMULATIONS = ("fixed", "adaptive")
COMM_DTYPES = ("auto", "bf16", "fp32")


class ACCOConfigError(ValueError):
    """An invalid ACCO option or an unsupported DeepSpeed combination. The message says the fix."""


class ACCOConfig(BaseModel):
    """The ``optimizer.params`` of a DeepSpeed config whose optimizer type is ``ACCO``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(1e-3, description="AdamW learning rate (the LR scheduler of the config overrides it).")
    """AdamW learning rate; a DeepSpeed/HF scheduler drives it per committed optimizer step."""

    betas: Tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""

    eps: float = 1e-8
    """AdamW epsilon, added to sqrt(v_hat); must be > 0."""

    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW), >= 0. Per-group values passed in model_parameters win."""

    mode: Literal["acco", "dpu", "sync"] = "acco"
    """acco: two-stage delay-compensated pipeline. dpu: delayed parameter update (one-round-stale
    gradients, the baseline ACCO fixes). sync: no overlap, exactly DeepSpeed ZeRO-1."""

    accumulation: Literal["fixed", "adaptive"] = "fixed"
    """fixed: every round takes exactly its share of micro-batches (GAS/2 in acco, GAS in dpu/sync).
    adaptive: a round takes at least its share and keeps accumulating until the communication of
    the previous round is done (acco and dpu only)."""

    comm_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """dtype of the gradient communication buffer (accumulation, reduce-scatter). auto: the model's
    parameter dtype (bf16 when the config enables bf16, else fp32), as DeepSpeed does."""

    max_micro_batches_per_round: int | None = None
    """adaptive only: upper bound on the micro-batches one round may accumulate before the compute
    waits for the communication (None: no bound)."""

    comm_timeout_s: float = 300.0
    """Seconds a rank waits for the communication of a round (or a peer) before raising an error
    that names the stalled collective, instead of hanging forever."""

    @field_validator("lr")
    @classmethod
    def _lr(cls, v: float) -> float:
        if not v >= 0.0:
            raise ValueError(f"lr must be >= 0, got {v}")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: Tuple[float, float]) -> Tuple[float, float]:
        for i, b in enumerate(v):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
        return v

    @field_validator("eps")
    @classmethod
    def _eps(cls, v: float) -> float:
        if not v > 0.0:
            raise ValueError(f"eps must be > 0, got {v}")
        return v

    @field_validator("weight_decay")
    @classmethod
    def _wd(cls, v: float) -> float:
        if not v >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {v}")
        return v

    @field_validator("max_micro_batches_per_round")
    @classmethod
    def _max_mb(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_micro_batches_per_round must be >= 1 or null, got {v}")
        return v

    @field_validator("comm_timeout_s")
    @classmethod
    def _timeout(cls, v: float) -> float:
        if not v > 0.0:
            raise ValueError(f"comm_timeout_s must be > 0, got {v}")
        return v

    @model_validator(mode="after")
    def _combinations(self) -> ACCOConfig:
        if self.mode == "sync" and self.accumulation == "adaptive":
            raise ValueError(
                "accumulation='adaptive' needs communication that overlaps the compute; "
                "mode='sync' has none. Use mode='acco' or 'dpu', or accumulation='fixed'."
            )
        if self.accumulation == "fixed" and self.max_micro_batches_per_round is not None:
            raise ValueError(
                "max_micro_batches_per_round applies to accumulation='adaptive' only; remove it."
            )
        return self

    @classmethod
    def from_params(cls, params: dict | None) -> ACCOConfig:
        """Build from the config's ``optimizer.params``; raise ACCOConfigError with every problem found."""
        params = dict(params or {})
        try:
            return cls(**params)
        except ValidationError as err:
            lines = []
            for e in err.errors():
                key = ".".join(str(x) for x in e["loc"])
                msg = e["msg"].removeprefix("Value error, ")
                if not key:
                    lines.append(f"optimizer.params: {msg}")
                elif e["type"] == "extra_forbidden":
                    allowed = ", ".join(sorted(cls.model_fields))
                    lines.append(f"optimizer.params.{key}: unknown option (allowed: {allowed})")
                else:
                    lines.append(f"optimizer.params.{key}={e.get('input')!r}: {msg}")
            raise ACCOConfigError("Invalid ACCO optimizer config:\n  " + "\n  ".join(lines)) from None
