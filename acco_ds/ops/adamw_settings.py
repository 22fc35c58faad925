"""The AdamW settings of one parameter group: one type from the config to the kernels' ABI.

Where it flows (see docs/DEVELOPING.md, "Adding an optimizer option"):

- ``ACCOConfig.adamw_settings()`` (acco_ds/config.py): the config's settings, the defaults of every parameter
  group; ``acco_ds.deepspeed.optimizer`` fills the groups' torch-style keys (:data:`TORCH_KEYS`, what LR
  schedulers drive) with them (:meth:`AdamWSettings.torch_kwargs`).
- at each engine step the optimizer reads the groups back (:meth:`AdamWSettings.from_param_group`); the pipeline
  (acco_ds/core/pipeline.py) keeps them per step, also in checkpoints (``dataclasses.asdict``: the field names
  are the stored keys), and turns the settings of the step a job computes into the kernel scalars
  (:meth:`AdamWSettings.hyper_scalars`), one row of the job's hyper table.
- the job (acco_ds/core/round_job.py) hands its row to ``acco_ds.ops.adamw.adamw_step`` as ``hyper_tensor``;
  the kernels read it as ``AdamWHyper`` (csrc/adamw/adamw_math.h), whose fields are :data:`KERNEL_FIELDS` in
  this order (tests/ops/test_adamw_settings.py checks the header and the built modules against the list).
- ``adamw_step(lr=..., beta1=..., ..., step=...)`` takes the same fields as keywords; the reference
  (acco_ds/core/reference.py) drives ``torch.optim.AdamW`` with :meth:`AdamWSettings.torch_kwargs`.

Importing this module imports neither torch nor any other acco_ds module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping, Sequence

KERNEL_FIELDS = (
    "decay",
    "beta1",
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "bc2_sqrt",
    "eps",
    "step_size",
)
"""The scalars the kernels use, in ``AdamWHyper``'s order (:meth:`AdamWSettings.hyper_scalars` returns them): 1 -
lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2, sqrt(1 - beta2**step), eps, lr / (1 - beta1**step)."""

TORCH_KEYS = ("lr", "betas", "eps", "weight_decay")
"""The keys of a ``torch.optim.AdamW`` parameter group that hold these settings."""


@dataclass(frozen=True)
class AdamWSettings:
    """One parameter group's AdamW settings (torch.optim.AdamW's meaning; decoupled weight decay).

    Construction does not validate (an LR schedule may go where a direct call may not): :meth:`check` does,
    where a call takes settings from a user (``adamw_step``, ``hyper_tensor``)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def from_torch(cls, lr: float, betas: Sequence[float], eps: float, weight_decay: float) -> AdamWSettings:
        """From torch.optim.AdamW's argument form (``betas`` a pair), each value as a float."""
        beta1, beta2 = betas
        return cls(float(lr), float(beta1), float(beta2), float(eps), float(weight_decay))

    @classmethod
    def from_param_group(cls, group: Mapping) -> AdamWSettings:
        """From a torch parameter group's :data:`TORCH_KEYS` (the values a scheduler set), as floats."""
        return cls.from_torch(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    @property
    def betas(self) -> tuple:
        return (self.beta1, self.beta2)

    def torch_kwargs(self) -> dict:
        """``{"lr", "betas", "eps", "weight_decay"}``: torch.optim.AdamW's arguments / a parameter group's keys."""
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}

    def check(self, who: str, step) -> None:
        """Raise ValueError naming the first bad setting, ``step`` included (``who`` prefixes the message):
        step an int >= 1, betas in [0, 1), lr, eps and weight_decay finite and >= 0."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(
                f"{who}: step must be an int >= 1 (the 1-based step being computed), got {step!r}."
            )
        for arg, x in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= float(x) < 1.0:
                raise ValueError(f"{who}: {arg} must be in [0, 1), got {x!r}.")
        for arg, x in (("lr", self.lr), ("eps", self.eps), ("weight_decay", self.weight_decay)):
            check_finite_nonneg(who, arg, x)

    def hyper_scalars(self, step: int) -> tuple:
        """The :data:`KERNEL_FIELDS` of step ``step`` (1-based), computed in double on the host as
        torch.optim.AdamW does; the kernels round each to fp32 once."""
        lr, beta1, beta2 = float(self.lr), float(self.beta1), float(self.beta2)
        eps, weight_decay = float(self.eps), float(self.weight_decay)
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
        return (
            1.0 - lr * weight_decay,
            beta1,
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            math.sqrt(bc2),
            eps,
            lr / bc1,
        )


SETTING_FIELDS = tuple(f.name for f in fields(AdamWSettings))
"""``("lr", "beta1", "beta2", "eps", "weight_decay")``: the fields, as ``adamw_step`` takes them (with ``step``)."""


def check_finite_nonneg(who: str, arg: str, x) -> None:
    """Raise ValueError unless ``x`` is a finite number >= 0."""
    if not (math.isfinite(float(x)) and float(x) >= 0.0):
        raise ValueError(f"{who}: {arg} must be finite and >= 0, got {x!r}.")
