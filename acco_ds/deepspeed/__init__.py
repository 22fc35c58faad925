"""The DeepSpeed integration: the only package that touches DeepSpeed internals."""

from acco_ds.deepspeed.register import register

__all__ = ["register"]
