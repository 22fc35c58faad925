"""Registration of ``"type": "ACCO"`` with DeepSpeed: the only module that patches DeepSpeedEngine.

DeepSpeed has no registry for third-party optimizers. ``register()`` wraps five engine methods
(idempotently): ``_is_supported_optimizer`` accepts "acco" in any case, and
``_configure_optimizer`` builds the ACCO optimizer for such a config (with no client optimizer)
and turns off the engine's own gradient all-reduce for that engine; ``save_checkpoint`` and
``load_checkpoint`` of an ACCO engine go through ``checkpoint.guard`` (a save interrupted at any point
leaves ``latest`` on a complete checkpoint; truncated files and another model fail clearly);
``train(mode)`` of an ACCO engine also shows the committed weights in eval mode, and
``_consolidated_16bit_state_dict`` (AutoTP's full-model export) gathers the committed weights
(``evaluation``). Any
other optimizer goes through DeepSpeed's original methods unchanged. Patching the class covers
every way an engine is built: ``deepspeed.initialize``, the HF Trainer and accelerate.
"""

from __future__ import annotations

import functools

from acco_ds.deepspeed.checkpoint import guard
from acco_ds.deepspeed.engine_setup import configure_acco
from acco_ds.deepspeed.evaluation import consolidated_committed

OPTIMIZER_NAME = "acco"
_PATCHED_FLAG = "_acco_ds_patched"


def is_acco_name(name) -> bool:
    return isinstance(name, str) and name.lower() == OPTIMIZER_NAME


def _is_acco_engine(engine) -> bool:
    return getattr(getattr(engine, "optimizer", None), "pipeline", None) is not None and is_acco_name(
        engine._config.optimizer_name
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
        return configure_acco(self, client_optimizer, model_parameters)

    original_save = DeepSpeedEngine.save_checkpoint
    original_load = DeepSpeedEngine.load_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, **kwargs):  # noqa: B006
        if not _is_acco_engine(self):
            return original_save(self, save_dir, tag, client_state, save_latest, **kwargs)
        return guard.save_checkpoint(self, original_save, save_dir, tag, client_state, save_latest, **kwargs)

    @functools.wraps(original_load)
    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        if not _is_acco_engine(self):
            return original_load(self, load_dir, tag, **kwargs)
        return guard.load_checkpoint(self, original_load, load_dir, tag, **kwargs)

    original_train = DeepSpeedEngine.train

    @functools.wraps(original_train)
    def train(self, mode=True):
        out = original_train(self, mode)
        if getattr(self, "_config", None) is not None and _is_acco_engine(self):
            self.optimizer._view.on_engine_mode(bool(mode))
        return out

    original_consolidated = DeepSpeedEngine._consolidated_16bit_state_dict

    @functools.wraps(original_consolidated)
    def _consolidated_16bit_state_dict(self, *args, **kwargs):
        if not _is_acco_engine(self):
            return original_consolidated(self, *args, **kwargs)
        return consolidated_committed(self, original_consolidated, *args, **kwargs)

    DeepSpeedEngine._consolidated_16bit_state_dict = _consolidated_16bit_state_dict
    DeepSpeedEngine.train = train
    DeepSpeedEngine._is_supported_optimizer = _is_supported_optimizer
    DeepSpeedEngine._configure_optimizer = _configure_optimizer
    DeepSpeedEngine.save_checkpoint = save_checkpoint
    DeepSpeedEngine.load_checkpoint = load_checkpoint
    DeepSpeedEngine._acco_original_save_checkpoint = original_save  # DeepSpeed's own, for tests
    setattr(DeepSpeedEngine, _PATCHED_FLAG, True)
