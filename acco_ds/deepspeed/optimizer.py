"""ACCOZeroOptimizer: the object a DeepSpeedEngine drives when its config says "type": "ACCO".

What the engine calls and what happens:
- ``backward_prologue()`` at the start of every micro-batch backward (from the engine's output hooks, or from the
  hook ``scale_if_loss`` puts on the loss, which covers a loop calling ``engine.module(...)`` directly, as programs
  training several engines do): the parameters' ``.grad`` are views
  into the round's communication buffer, so autograd accumulates into it in place (bf16 parameters
  with fp32 communication: hooks fold each gradient into it as backward produces it). The engine's
  boundary and ``no_sync()`` are declared to the pipeline there: the last micro-batch of a compressed
  round quantizes its gradients as they arrive (``core.fused_round_end``).
- ``set_gradient_accumulation_boundary(flag)`` (ZeROOptimizer's) in every backward's prologue and from
  ``engine.set_gradient_accumulation_boundary`` (accelerate, the HF Trainer, loops that mark their own
  boundaries): the engine, not a count, says which micro-batch ends an optimizer step.
- ``backward_epilogue()`` after every micro-batch backward, with the engine's boundary flag
  (``engine.is_gradient_accumulation_boundary()``) and ``engine.inside_no_sync_ctxt`` (``no_sync()``,
  ``coalesce_grad_reduction()``: no step ends there, while a round that ends by its count, acco's peek, still
  does, so accelerate's ``accumulate()`` runs the bare loop's rounds); a round may end here
  (``core.pipeline``). With fixed accumulation the step's COMMIT is launched only at a micro-batch the
  engine marks as the boundary, however many micro-batches the step took (a data loader's shorter last
  accumulation is a step); in sync it is launched and waited for at ``step()``, where ZeRO-1 steps, so that
  DeepSpeed's gradient accessors read and edit the step's gradient in between (``accessors``).
- ``step()`` at each accumulation boundary: ends the step if its last backward was not marked as the
  boundary (``managed_gradient_accumulation=false``, a boundary set only before ``step()``, the flush of
  a coalesced reduction), then bookkeeping; the engine steps its LR scheduler right after, which the
  next round picks up. A step with no backward since the last one is refused and changes nothing.
- ``zero_grad()``: nothing to do: the round's gradients live in ACCO's buffer, zeroed at each
  round end; the ``.grad`` views into it stay (or are put back by the next ``backward_prologue``).
- ``param_groups`` / ``optimizer``: those of a real ``torch.optim.AdamW`` over the fp32 master
  shards (never stepped itself; ``param_groups.ParamGroupHolder``), so DeepSpeed, HF and torch LR schedulers
  drive lr/betas/wd.
- ``state`` (= ``optimizer.state``): per fp32 master shard, as DeepSpeed's ZeRO-1 exposes its inner
  optimizer's: ``exp_avg`` and ``exp_avg_sq`` are ACCO's moment shards themselves (views, not copies),
  ``step`` a 0-dim fp32 tensor, the applied commits (``ShardState``).
- ``loss_scaler``, ``dynamic_loss_scale``, ``cur_scale`` / ``loss_scale``: ZeRO-1's fp16 face, read off the
  pipeline's device loss scaler when asked (``loss_scaler_view``); without fp16 a static scale of 1.0, as ZeRO-1's.

At the engine's k-th accumulation boundary in ``acco`` mode the commit producing theta^k has just
been launched and the model holds the estimate theta~^k; ``committed_parameters`` semantics
(DeepSpeed's ``safe_get_full_fp32_param`` and friends) return the committed values after waiting
for the work in flight.
"""

from __future__ import annotations

import weakref
from typing import List

import torch
import torch.distributed as dist
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.utils import is_model_parallel_parameter

from acco_ds.config import ACCOConfig, ACCOConfigError
from acco_ds.core.pipeline import ACCOPipeline
from acco_ds.deepspeed import checkpoint, overlap_report
from acco_ds.deepspeed.accessors import hide_step_gradients, link_accessors
from acco_ds.deepspeed.checkpoint import memory as memory_records
from acco_ds.deepspeed.evaluation import EvaluationView
from acco_ds.deepspeed.loss_scaler_view import loss_scaler_view, read_only_error
from acco_ds.deepspeed.monitor import ACCOMonitor
from acco_ds.deepspeed.param_groups import ParamGroupHolder
from acco_ds.ops.adamw_settings import AdamWSettings


def normalize_param_groups(model_parameters, cfg: ACCOConfig) -> List[dict]:
    """Param groups with trainable, de-duplicated parameters and every AdamW key filled in.

    Accepts what ``deepspeed.initialize(model_parameters=...)`` accepts: parameters or dicts.
    Frozen parameters (requires_grad=False) are left out, like DeepSpeed's ZeRO; a parameter
    listed twice (tied weights) is kept in its first group only."""
    items = list(model_parameters)
    raw = items if items and isinstance(items[0], dict) else [{"params": items}]
    seen, groups = set(), []
    for i, g in enumerate(raw):
        if not isinstance(g, dict) or "params" not in g:
            raise ACCOConfigError(
                f"model_parameters[{i}] must be a parameter or a dict with 'params'; got {type(g)}"
            )
        params = g["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        kept = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                kept.append(p)
        if not kept:
            continue
        group = {k: v for k, v in g.items() if k != "params"}
        for key, value in cfg.adamw_settings().torch_kwargs().items():
            group.setdefault(key, value)
        group["betas"] = tuple(group["betas"])
        group["params"] = kept
        groups.append(group)
    if not groups:
        raise ACCOConfigError("model_parameters holds no trainable parameter (all have requires_grad=False).")
    return groups


class ShardState(dict):
    """``optimizer.state[master]`` of one parameter group: ``{"step", "exp_avg", "exp_avg_sq"}`` as torch's
    AdamW and DeepSpeed's ZeRO-1 keep them, holding ACCO's own moment shards (views of the committed
    state) and the pipeline's applied-commit count (``ACCOPipeline.step_tensor``, updated in place).

    Reading a key first waits for the round in flight on this rank (fixed accumulation; with adaptive
    accumulation only when that round is done: a peer may not have launched it yet) and counts a finished
    commit not yet swapped in, so the moments and the step agree: the committed state after the last
    finished commit. ``current()``: the plain dict of the current values, each read as ``state[key]`` reads it.
    A ShardState pickles as that dict, and torch's pytree (``tree_map``, ``tree_flatten``) flattens it as that
    dict: unregistered, a dict subclass is one opaque leaf there, which ``tree_map`` returns unmapped."""

    def __init__(self, pipeline, buffers):
        super().__init__(step=pipeline.step_tensor, exp_avg=buffers.exp_avg, exp_avg_sq=buffers.exp_avg_sq)
        self._pipeline = pipeline

    def __getitem__(self, key):
        from acco_ds.core.snapshot import pending_applied_commits

        pipeline = self._pipeline
        if pipeline.in_flight is not None and (
            not pipeline.adaptive or pipeline.executor.done(pipeline.in_flight[0])
        ):
            pipeline.sync_in_flight()
        value = super().__getitem__(key)
        if key == "step":
            value.fill_(float(pipeline.state_step + pending_applied_commits(pipeline)))
        return value

    def current(self) -> dict:
        return {key: self[key] for key in dict.keys(self)}

    def __reduce__(self):
        return dict, (self.current(),)


torch.utils._pytree.register_pytree_node(
    ShardState,
    lambda state: (list(state.current().values()), list(dict.keys(state))),
    lambda values, keys: dict(zip(keys, values)),
    serialized_type_name=f"{__name__}.ShardState",
    flatten_with_keys_fn=lambda state: (
        [(torch.utils._pytree.MappingKey(k), v) for k, v in state.current().items()],
        list(dict.keys(state)),
    ),
)


def _graph_task() -> int:
    """The id of the autograd graph task running on this thread (each backward has its own), -1 outside one."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else int(current())


class ACCOZeroOptimizer(ZeROOptimizer):
    """See the module docstring."""

    _coalesce_grad_reduction = False  # the engine's coalesce_grad_reduction() requires the attribute
    steps_taken = 0  # engine optimizer steps of this process (step() calls that were not refused)
    overlap_notice: str | None = None  # the notice said when the run overlaps little (``overlap_report``)
    memory_notice: str | None = None  # the notice said when memory_state records no step (``memory_records``)

    def __init__(
        self,
        model_parameters,
        cfg: ACCOConfig,
        *,
        gradient_accumulation_steps: int,
        gradient_clipping: float,
        dp_process_group=None,
        tp_group=None,
        loss_scale=None,
        offload=None,
    ):
        """``loss_scale``: fp16's loss scaler settings (``core.loss_scale.LossScaleSpec``), None without fp16.
        ``offload``: optimizer offload (``core.host_step.OffloadSpec``), None without it."""
        super().__init__()
        self.cfg = cfg
        self.dp_process_group = dp_process_group
        self.gradient_accumulation_steps = gradient_accumulation_steps
        groups = normalize_param_groups(model_parameters, cfg)
        self.bit16_groups = [g["params"] for g in groups]
        self.pipeline = ACCOPipeline(
            self.bit16_groups,
            self._current_hypers,
            cfg,
            gradient_accumulation_steps,
            gradient_clipping,
            dp_process_group,
            tp_group=tp_group,
            tp_sharded=[[bool(is_model_parallel_parameter(p)) for p in g] for g in self.bit16_groups],
            loss_scale=loss_scale,
            offload=offload,
        )
        torch_groups = []
        for g, b in zip(groups, self.pipeline.groups):
            torch_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [b.master]})
        self.optimizer = ParamGroupHolder(torch_groups)  # holds param_groups for schedulers; never stepped
        self._link_state()
        self.single_partition_of_fp32_groups = [b.master for b in self.pipeline.groups]
        self.overflow = False
        self._global_grad_norm = None
        self.custom_loss_scaler = False
        self.torch_autocast_gradscaler = None
        self._loss_scaler = loss_scaler_view(self.pipeline)
        self.dynamic_loss_scale = bool(loss_scale is not None and loss_scale.dynamic)
        self.partition_gradients = False
        self._since_step = 0
        self._prologue_task = None  # the autograd graph task whose backward the prologue last ran for
        self._view = EvaluationView(self.pipeline)
        link_accessors(self)

    # -- what torch-style code reads ----------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        """Per fp32 master shard, ``{"step", "exp_avg", "exp_avg_sq"}`` (``ShardState``), as ZeRO-1's."""
        self._link_state()
        return self.optimizer.state

    def _link_state(self) -> None:
        """Put a ``ShardState`` per group into the inner AdamW's ``state`` (again after a
        ``load_state_dict`` replaced it). The checkpoint files do not change: they take the inner
        optimizer's ``param_groups`` only (``checkpoint.state_dict``)."""
        for b in self.pipeline.groups:
            if not isinstance(self.optimizer.state.get(b.master), ShardState):
                self.optimizer.state[b.master] = ShardState(self.pipeline, b)

    @property
    def _micro_batches_since_step(self) -> int:
        """Micro-batch backwards since the last optimizer step (saved in ACCO checkpoints). Setting it
        (a checkpoint load) also sets the pipeline's count of the step in progress."""
        return self._since_step

    @_micro_batches_since_step.setter
    def _micro_batches_since_step(self, value: int) -> None:
        self._since_step = int(value)
        self.pipeline.step_count = int(value)

    def _current_hypers(self) -> List[AdamWSettings]:
        """Every group's AdamW settings as the engine's LR scheduler left them."""
        return [AdamWSettings.from_param_group(g) for g in self.optimizer.param_groups]

    # -- what the engine calls ----------------------------------------------------------------
    def backward_prologue(self):
        """Before a micro-batch backward; the engine's boundary and ``no_sync()`` are known by now (DeepSpeed sets
        them before ``engine.backward``), and the epilogue reads the same ones: declared to the pipeline, they let
        a compressed round's last micro-batch quantize its gradients as they arrive (``core.fused_round_end``).

        Runs once per backward, from whichever comes first at its start: the hook :meth:`scale_if_loss` puts on the
        loss ``engine.backward`` runs backward on (every loop, the module called directly too), or the engine's own
        prologue (the output hooks ``engine(...)`` puts on its outputs: ``engine.backward`` and ``loss.backward()``).
        Called inside a backward, a second call for the same autograd graph task does nothing; called outside one
        (a bare optimizer), it always runs."""
        task = _graph_task()
        if task >= 0 and task == self._prologue_task:
            return
        self._prologue_task = task
        engine = self.engine
        if engine is None:
            self.pipeline.on_backward_start(boundary=None)
            return
        boundary, hold = self._engine_word(engine)
        self.pipeline.on_backward_start(boundary=boundary, hold=hold)

    def _engine_word(self, engine) -> tuple:
        """``(boundary, hold)`` of the micro-batch whose backward runs: ``hold`` inside ``no_sync()`` and
        ``coalesce_grad_reduction()`` (no step ends there). Inside ``no_sync()`` the engine's boundary flag means
        nothing (the step ends at an ``engine.step()`` outside it: DeepSpeed refuses one inside), so it is passed
        as False; inside a coalesced reduction it marks the block's last micro-batch, whose step the flush ends."""
        hold = bool(getattr(engine, "inside_no_sync_ctxt", False))
        boundary = bool(engine.is_gradient_accumulation_boundary())
        if hold and not self._coalesce_grad_reduction:
            boundary = False
        return boundary, hold

    def backward_epilogue(self, **kwargs):
        """After a micro-batch backward: hand the pipeline the engine's word on it (see the module
        docstring); without an engine (a bare optimizer) every gradient_accumulation_steps-th
        micro-batch is a boundary."""
        prologue_ran = self._prologue_task is not None
        self._prologue_task = None
        self._since_step += 1
        engine = self.engine
        if engine is None:
            self.pipeline.on_micro_batch_end()
            return
        if not prologue_ran:  # a bare loss.backward() through the module called directly, then the epilogue
            self.pipeline.adopt_grads()
        rounds = self.pipeline.stats.rounds
        boundary, hold = self._engine_word(engine)
        self.pipeline.on_micro_batch_end(boundary=boundary, hold=hold)
        hide_step_gradients(self, rounds)  # DeepSpeed's gradient accessors then ask accessors.py

    # the engine's coalesce_grad_reduction() flush (DeepSpeedEngine._flush_coalesced_reduction_zero12) calls
    # these three: the gradients are already in ACCO's buffer, and the flush is the step's boundary
    def setup_buckets(self) -> None:
        """Nothing to set up: ACCO has no reduction buckets."""

    def get_gradient_for_reduction(self, param):
        """None: no per-parameter reduction (the flush ends the whole step instead)."""
        return None

    def overlapping_partition_gradients_reduce_epilogue(self) -> None:
        """The end of a coalesced reduction: the step's accumulation ends here, as at a marked boundary."""
        rounds = self.pipeline.stats.rounds
        self.pipeline.close_step()
        hide_step_gradients(self, rounds)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError(
                "ACCOZeroOptimizer.step does not take a closure (the step runs on the comm stream)."
            )
        if self._since_step == 0:
            raise RuntimeError(
                "acco_ds: engine.step() at an accumulation boundary with no engine.backward(loss) since the last "
                "optimizer step: there is no gradient to step with (DeepSpeed's ZeRO-1 has none either). Nothing "
                "was changed. Allowed: at least one engine.backward(loss) before each optimizer step; set "
                "engine.set_gradient_accumulation_boundary(True) only for the last backward of a step."
            )
        rounds = self.pipeline.stats.rounds
        self.pipeline.end_step()
        hide_step_gradients(self, rounds)
        self._since_step = 0
        self.pipeline.read_swapped_commits()
        self.overflow = self._take_unreported_skip()
        self.pipeline.on_engine_step(lr_stepped=not self.overflow)
        # A torch LR scheduler wraps the inner AdamW's step() to see that the optimizer steps before it, and
        # warns "Detected call of `lr_scheduler.step()` before `optimizer.step()`" when not. ACCO never calls
        # that step (its AdamW runs in the round job), so mark it as that wrapper does. That is the truth: the
        # commit this engine step stands for takes the settings the schedule had after as many scheduler steps
        # as commits applied before it (ACCOPipeline._hypers_for), so no value of the schedule is skipped.
        self.optimizer._opt_called = True
        if self.pipeline.last_grad_norm is not None:
            self._global_grad_norm = self.pipeline.last_grad_norm.reshape(())
        if getattr(self, "_acco_monitor", None) is not None:
            self._acco_monitor.after_step(self)
        self.steps_taken += 1
        overlap_report.after_step(self)
        memory_records.after_step(self)

    def _take_unreported_skip(self) -> bool:
        """``overflow`` for this engine step: True when a commit skipped for a non-finite gradient has
        finished and not been reported yet (one skip per step; the engine counts it in ``skipped_steps``
        and does not step its LR scheduler, so the schedule follows the applied commits).

        In ``sync`` the boundary's own commit has finished: a skip is reported at the step that made it.
        In ``acco``/``dpu`` the commit launched at a boundary finishes during the next round, so its
        skip is reported one engine step later. On every device: ``step`` has the pipeline read the summaries of
        the commits swapped in first (``ACCOPipeline.read_swapped_commits``). The reported count is the engine's
        ``skipped_steps``
        (saved in DeepSpeed's checkpoints), or this optimizer's own counter without an engine."""
        engine = getattr(self, "engine", None)
        reported = getattr(engine, "skipped_steps", None)
        if reported is None:
            reported = getattr(self, "_skips_reported", 0)
        if self.pipeline.stats.skipped_steps <= reported:
            return False
        if engine is None:
            self._skips_reported = reported + 1
        return True

    def zero_grad(self, set_to_none: bool = True):
        """Nothing to zero: see the module docstring (clearing the buffer mid-round would lose the
        micro-batches already in it, which DeepSpeed's ZeRO-1 does not do either)."""

    def scale_if_loss(self, value):
        """What ``engine.backward`` (and ``engine.scale``) run backward on: the loss times the current round's loss
        scale with fp16 (``core.loss_scale``; a device tensor, no host read), the loss itself with bf16/fp32. The
        returned tensor carries a hook that runs :meth:`backward_prologue` when its backward starts, so the prologue
        runs when the module was called directly (``engine.module(x)``: no output hooks of the engine) as it does
        through ``engine(x)``. The loss is recorded for the monitor when it is enabled."""
        monitor = getattr(self, "_acco_monitor", None)
        if monitor is not None:
            monitor.record_loss(value)
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            return value
        scaled = self.pipeline.scale_loss(value)
        scaled.register_hook(self._prologue_hook)
        return scaled

    def _prologue_hook(self, grad):
        self.backward_prologue()

    @property
    def loss_scaler(self):
        """ZeRO-1's scaler object, read off ACCO's device scaler when asked (``loss_scaler_view``): DeepSpeed's
        ``DynamicLossScaler`` with dynamic fp16, its ``LossScaler`` with a static fp16 scale or bf16/fp32 (scale 1.0).
        The same object for the optimizer's life; it cannot be replaced (``LossScalerReadOnlyError``)."""
        return self._loss_scaler

    @loss_scaler.setter
    def loss_scaler(self, value):
        raise read_only_error("optimizer.loss_scaler (replacing the object)")

    @property
    def cur_scale(self) -> float:
        """The loss scale (ZeRO-1's ``cur_scale`` and ``loss_scale``: ``loss_scaler.cur_scale``; 1.0 without fp16).
        With dynamic fp16 a host read of the device state: the scale after the commits applied so far. Assigning it
        raises ``LossScalerReadOnlyError`` (ZeRO-1 would change its scale; ACCO's is decided on the device)."""
        return self._loss_scaler.cur_scale

    @cur_scale.setter
    def cur_scale(self, value):
        raise read_only_error("optimizer.cur_scale (and optimizer.loss_scale)")

    loss_scale = cur_scale

    # -- checkpoints (acco_ds.deepspeed.checkpoint) ---------------------------------------------
    swap_optimizer = False  # the engine reads it: no NVMe optimizer swapping

    @property
    def round_robin_bit16_groups(self):
        """The trainable parameters per group in flat-buffer order: the engine's ``param_shapes``."""
        return self.bit16_groups

    @property
    def engine(self):
        """The DeepSpeedEngine driving this optimizer (None before ``attach_engine`` or once it is gone)."""
        ref = getattr(self, "_engine_ref", None)
        return None if ref is None else ref()

    def attach_engine(self, engine) -> None:
        """Called once by the engine setup: keep a weak reference to the engine (parameter names for
        checkpoints), make ``engine.module.state_dict()`` return the committed parameters (see
        ``checkpoint.install_state_dict_hook``) and, when the engine's monitor is enabled, write
        ACCO's figures to it at every step."""
        self._engine_ref = weakref.ref(engine)
        self._acco_monitor = ACCOMonitor(engine) if engine.monitor.enabled else None
        self._state_dict_hook = checkpoint.install_state_dict_hook(self, engine.module)
        self._eval_hook = engine.module.register_forward_pre_hook(self._view.forward_pre_hook)

    def checkpoint_event_prologue(self):
        checkpoint.checkpoint_event_prologue(self)

    def checkpoint_event_epilogue(self):
        checkpoint.checkpoint_event_epilogue(self)

    def state_dict(self):
        return checkpoint.state_dict(self)

    def load_state_dict(
        self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=True, **kwargs
    ):
        checkpoint.load_state_dict(
            self, state_dict_list, load_optimizer_states, load_from_fp32_weights, **kwargs
        )
        self._link_state()

    def update_lp_params(self):
        checkpoint.update_lp_params(self)

    def _restore_from_bit16_weights(self):
        checkpoint.restart_at_master(self)

    def refresh_fp32_params(self):
        self._restore_from_bit16_weights()

    # -- evaluation (acco_ds.deepspeed.evaluation) ----------------------------------------------
    def eval(self) -> None:
        """Show the committed weights to the model until :meth:`train` (HF Trainer and accelerate call
        it around evaluation). Waits for the commit in flight; collective in adaptive accumulation."""
        self._view.eval()

    def train(self) -> None:
        """Put back the weights the compute side trains at (HF Trainer calls it at every step)."""
        self._view.train()

    def committed_weights(self):
        """``with engine.optimizer.committed_weights(): ...``: the model holds the committed weights
        inside the block (generation, a no_grad loop in training mode), the training weights after."""
        return self._view.committed()

    # -- ACCO's own API -----------------------------------------------------------------------
    @property
    def committed_steps(self) -> int:
        """Optimizer steps committed so far (the same on every rank)."""
        return self.pipeline.committed_steps

    def finish(self) -> None:
        """End of training, on every rank: finish the work in flight, load theta into the model."""
        self.pipeline.finish()

    def destroy(self) -> None:
        """``DeepSpeedEngine.destroy()``'s part: the jobs already launched finish, the worker threads end and the
        gloo groups the pipeline created are released (``ACCOPipeline.close``). It does not apply a commit still
        in flight to the model: call :meth:`finish` first for the trained weights. Idempotent."""
        self.pipeline.close()

    def stats(self) -> dict:
        out = self.pipeline.stats.as_dict()
        out.update(
            committed_steps=self.pipeline.committed_steps,
            applied_steps=self.pipeline.state_step,
            model_holds=self.pipeline.model_holds,
            mode=self.cfg.mode,
            accumulation=self.cfg.accumulation,
            **overlap_report.figures(self),
        )
        if self.pipeline.memory_state is not None:
            out.update(self.pipeline.memory_state.stats())
        return out

    def state_numel_per_rank(self) -> int:
        return sum(b.state_numel() for b in self.pipeline.groups)

    def world_size(self) -> int:
        return dist.get_world_size(self.dp_process_group)
