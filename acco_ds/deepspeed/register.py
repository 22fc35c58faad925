"""Registration of ``"type": "ACCO"`` with DeepSpeed: the only module that patches DeepSpeedEngine.

DeepSpeed has no registry for third-party optimizers. ``register()`` wraps two engine methods
(idempotently): ``_is_supported_optimizer`` accepts "acco" in any case, and
``_configure_optimizer`` builds the ACCO optimizer for such a config (with no client optimizer)
and turns off the engine's own gradient all-reduce for that engine; any other optimizer goes
through DeepSpeed's original method unchanged. Patching the class covers every way an engine is
built: ``deepspeed.initialize``, the HF Trainer and accelerate.
"""

from __future__ import annotations

import functools
import os

from acco_ds.config import ACCOConfigError

OPTIMIZER_NAME = "acco"
TESTED_DEEPSPEED = ((0, 19, 8), (0, 20, 0))  # [low, high)
ALLOW_UNTESTED_ENV = "ACCO_DS_ALLOW_UNTESTED_DEEPSPEED"
_PATCHED_FLAG = "_acco_ds_patched"


def is_acco_name(name) -> bool:
    return isinstance(name, str) and name.lower() == OPTIMIZER_NAME


def _version_tuple(text: str) -> tuple:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def check_deepspeed_version(version: str) -> None:
    """Raise unless ``version`` is in the tested range (or the override variable is set)."""
    low, high = TESTED_DEEPSPEED
    if low <= _version_tuple(version) < high or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    fmt = ".".join
    raise ACCOConfigError(
        f"acco_ds is tested with DeepSpeed >= {fmt(map(str, low))} and < {fmt(map(str, high))}; found "
        f"deepspeed=={version}. Install a tested version (pip install 'deepspeed>={fmt(map(str, low))},"
        f"<{fmt(map(str, high))}') or set {ALLOW_UNTESTED_ENV}=1 to try this one at your own risk."
    )


def register() -> None:
    """Teach DeepSpeedEngine the "ACCO" optimizer type. Idempotent; safe to call many times."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if getattr(DeepSpeedEngine, _PATCHED_FLAG, False):
        return
    original_supported = DeepSpeedEngine._is_supported_optimizer
    original_configure = DeepSpeedEngine._configure_optimizer

    @functools.wraps(original_supported)
    def _is_supported_optimizer(self, optimizer_name):
        return is_acco_name(optimizer_name) or original_supported(self, optimizer_name)

    @functools.wraps(original_configure)
    def _configure_optimizer(self, client_optimizer, model_parameters):
        if not is_acco_name(self._config.optimizer_name):
            return original_configure(self, client_optimizer, model_parameters)
        from acco_ds.deepspeed.engine_setup import configure_acco

        return configure_acco(self, client_optimizer, model_parameters)

    DeepSpeedEngine._is_supported_optimizer = _is_supported_optimizer
    DeepSpeedEngine._configure_optimizer = _configure_optimizer
    setattr(DeepSpeedEngine, _PATCHED_FLAG, True)
