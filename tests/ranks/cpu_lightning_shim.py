"""Test-environment shim: let PyTorch Lightning's ``DeepSpeedStrategy`` run on CPU ranks.

Lightning 2.6's ``DeepSpeedStrategy.setup_environment`` refuses any accelerator but its ``CUDAAccelerator``
("The DeepSpeed strategy is only supported on CUDA GPUs"), its ``setup_distributed`` then requires each
rank's device index to be its local rank, and it hands ``deepspeed.initialize`` that index as
``args.device_rank`` (a CPU device has none: DeepSpeed's engine compares it with 0), although DeepSpeed itself runs on CPU (its CPU
accelerator, gloo: ``DS_ACCELERATOR=cpu``). Those are Lightning's checks with any DeepSpeed optimizer, not ACCO's;
on GPU machines nothing here is needed and the Lightning script runs unchanged.

``apply()`` (on a machine without CUDA) lifts the three for CPU devices only: ``setup_environment`` does the rest of
what it does (``DDPStrategy.setup_environment``), the device-index check passes CPU devices, and the engine gets
the rank's local rank as its ``device_rank`` (what DeepSpeed's engine takes without ``args``).
Everything else (``deepspeed.init_distributed``, ``deepspeed.initialize`` with the strategy's config, the engine's
backward and step in Lightning's loop) is Lightning's own code.
"""

from __future__ import annotations

import torch


def apply() -> None:
    if torch.cuda.is_available():
        return
    from pytorch_lightning.accelerators import CPUAccelerator
    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy
    from pytorch_lightning.strategies import deepspeed as lightning_deepspeed

    original = DeepSpeedStrategy.setup_environment
    if getattr(original, "_acco_cpu_shim", False):
        return

    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            DDPStrategy.setup_environment(self)
            return
        original(self)

    validate = lightning_deepspeed._validate_device_index_selection

    def validate_device_index_selection(parallel_devices) -> None:
        if all(d.type == "cpu" for d in parallel_devices):
            return
        validate(parallel_devices)

    setup_model_and_optimizer = DeepSpeedStrategy._setup_model_and_optimizer

    def cpu_setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        if self.root_device.type != "cpu":
            return setup_model_and_optimizer(self, model, optimizer, lr_scheduler)
        import deepspeed

        initialize = deepspeed.initialize

        def cpu_initialize(*args, **kwargs):
            ns = kwargs.get("args")
            if ns is not None and getattr(ns, "device_rank", 0) is None:
                ns.device_rank = self.local_rank
            return initialize(*args, **kwargs)

        deepspeed.initialize = cpu_initialize
        try:
            return setup_model_and_optimizer(self, model, optimizer, lr_scheduler)
        finally:
            deepspeed.initialize = initialize

    setup_environment._acco_cpu_shim = True
    DeepSpeedStrategy._setup_model_and_optimizer = cpu_setup_model_and_optimizer
    DeepSpeedStrategy.setup_environment = setup_environment
    lightning_deepspeed._validate_device_index_selection = validate_device_index_selection
