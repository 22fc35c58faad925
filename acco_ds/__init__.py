"""acco_ds: ACCO (Accumulate While You Communicate, arXiv 2406.02613) as a DeepSpeed optimizer.

``import acco_ds`` registers the optimizer type "ACCO" with DeepSpeed; then
``"optimizer": {"type": "ACCO", "params": {...}}`` in a ZeRO stage 1 config trains with the
gradient communication and the sharded AdamW overlapped with the next gradients' computation.
"""

from acco_ds.config import ACCOConfig, ACCOConfigError

__version__ = "0.1.0"


def register() -> None:
    """Register "ACCO" with DeepSpeedEngine (idempotent). Called on import when DeepSpeed is present."""
    from acco_ds.deepspeed.register import register as _register

    _register()


try:
    import deepspeed as _deepspeed  # noqa: F401
except ImportError:  # the core and the kernels work without DeepSpeed
    pass
else:
    register()

__all__ = ["ACCOConfig", "ACCOConfigError", "register", "__version__"]
