"""ACCO checkpoints in DeepSpeed's ZeRO-1 layout.

Modules, in the order a load goes through them:

- ``guard``: ``engine.save_checkpoint`` / ``load_checkpoint`` of an ACCO engine (register.py routes them
  here): a crash-safe save (staging folder, ``latest`` written last) and the load around DeepSpeed's own.
- ``preflight``: reads what a load needs before anything changes and picks its route (exact resume,
  committed state re-sharded, universal checkpoint, weights only).
- ``zero_state``: the optimizer's ``state_dict`` / ``load_state_dict`` with DeepSpeed ZeRO-1's keys plus
  ACCO's in-flight state, the checkpoint events, the module ``state_dict`` hook (committed weights) and the
  re-sharded load of the committed state.
- ``reshard``: the committed state of any ZeRO-1/2 or ACCO checkpoint on any world size, and DeepSpeed
  universal checkpoints, sliced to this run's shards by parameter name.
- ``files``: reading checkpoint files (memory-mapped, completeness checks) and ``ACCOCheckpointError``.

The names below are what the optimizer (``acco_ds.deepspeed.optimizer``) calls.
"""

from acco_ds.deepspeed.checkpoint.files import ACCOCheckpointError
from acco_ds.deepspeed.checkpoint.zero_state import (
    checkpoint_event_epilogue,
    checkpoint_event_prologue,
    install_state_dict_hook,
    load_state_dict,
    restart_at_master,
    state_dict,
    update_lp_params,
)

__all__ = [
    "ACCOCheckpointError",
    "checkpoint_event_epilogue",
    "checkpoint_event_prologue",
    "install_state_dict_hook",
    "load_state_dict",
    "restart_at_master",
    "state_dict",
    "update_lp_params",
]
