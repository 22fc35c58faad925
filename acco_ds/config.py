"""ACCOConfig: the options of ``"optimizer": {"type": "ACCO", "params": {...}}``.

Every field is validated with a message that names the key, the value seen and what is allowed;
unknown keys are an error. The model knows nothing of DeepSpeed: the checks that need the rest of
the DeepSpeed config (ZeRO stage, gradient_accumulation_steps, ...) live in
``acco_ds.deepspeed.validate``.

Defaults: every key DeepSpeed's ``"type": "AdamW"`` also takes (lr, betas, eps, weight_decay) defaults
to what DeepSpeed 0.19.8 gives it (``DeepSpeedEngine._configure_basic_optimizer`` builds FusedAdam, or
DeepSpeedCPUAdam with CPU offload, with ``adam_w_mode=True``: decoupled weight decay, as ACCO's AdamW;
their defaults lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0), so a config that changes only
the optimizer's ``type`` trains with the same AdamW. (``"torch_adam": true`` would build
``torch.optim.AdamW``, whose weight_decay defaults to 0.01; ACCO does not take that key.)
"""

from __future__ import annotations

import math
import os
from typing import Literal, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MODES = ("acco", "dpu", "sync")
ACCUMULATIONS = ("fixed", "adaptive")
COMM_DTYPES = ("auto", "bf16", "fp16", "fp32")
MAX_BLOCK_SIZE = 1 << 20
MIN_TIMEOUT_S = 1.0
"""Shortest comm_timeout_s accepted: below it a loaded machine would time out healthy rounds."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest comm_timeout_s accepted (a week); larger values overflow the backends' millisecond timers."""

MAX_PEEK_LR_SCALE = 4.0
"""Largest peek_lr_scale accepted: an estimate further than four steps ahead is no estimate of the next parameters."""

MAX_HOST_THREADS = 1024
"""Largest host_threads accepted: more OpenMP threads than any host has CPUs would only oversubscribe it."""

ALLOWED = {
    "lr": "a finite number >= 0",
    "betas": "two finite numbers in [0, 1), e.g. [0.9, 0.999]",
    "eps": "a finite number > 0",
    "weight_decay": "a finite number >= 0",
    "mode": "'acco', 'dpu' or 'sync'",
    "accumulation": "'fixed' or 'adaptive'",
    "comm_dtype": "'auto', 'bf16', 'fp16' or 'fp32'",
    "max_micro_batches_per_round": "null (no bound) or an integer >= 1, with accumulation='adaptive'",
    "comm_timeout_s": f"a number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}]",
    "host_threads": f"'auto' or an integer in [1, {MAX_HOST_THREADS}]",
    "peek_lr_scale": f"a finite number in (0, {MAX_PEEK_LR_SCALE:g}], other than 1 with mode='acco' only",
    "compression": "an object with keys among commit, peek, block_size, error_feedback, all_gather, fuse_round_end, e.g. "
    '{"commit": "int8", "peek": "int8", "block_size": 256, "error_feedback": true}',
    "compression.commit": "'none', 'int8' or 'int4'",
    "compression.peek": "'none', 'int8' or 'int4' (the last two with mode='acco' only: dpu and sync have no peek)",
    "compression.block_size": f"an integer in [1, {MAX_BLOCK_SIZE}]",
    "compression.error_feedback": "true or false",
    "compression.all_gather": "'none', 'int8' or 'int4'",
    "compression.fuse_round_end": "true or false",
    "memory_state": 'an object with keys among enabled, dir, peer_copy, peer_copy_form, run_id, e.g. {"enabled": true}',
    "memory_state.enabled": "true or false",
    "memory_state.peer_copy": "true or false",
    "memory_state.peer_copy_form": "'inputs' or 'state'",
    "memory_state.dir": "an absolute path to a folder in a memory file system (default /dev/shm/acco_ds)",
    "memory_state.run_id": "null (the launcher's run id, TORCHELASTIC_RUN_ID) or a non-empty string",
}
"""What each option accepts, quoted in the error messages."""


class ACCOConfigError(ValueError):
    """An invalid ACCO option or an unsupported DeepSpeed combination. The message says the fix."""


class _ComboError(ValueError):
    """A combination of two valid options that does not work together (raised by the model validator)."""

    def __init__(self, key: str, value, text: str):
        super().__init__(text)
        self.key, self.value, self.text = key, value, text

    def line(self) -> str:
        return f"optimizer.params.{self.key}={self.value!r}: {self.text}"


def _strict_bool(cls, v):
    """A validator of boolean options: JSON's true or false only (no 0/1, no strings)."""
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


def _string(cls, v):
    """A choice's value must be a string before pydantic checks it against the allowed ones (no coercion)."""
    if not isinstance(v, str):
        raise ValueError("must be a string")
    return v


class CompressionConfig(BaseModel):
    """``optimizer.params.compression``: compressed rounds with error feedback (docs/ALGORITHM.md, "Compressed
    rounds"). Default: everything off, so the rounds send what they send without the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    commit: Literal["none", "int8", "int4"] = "none"
    """The gradient exchange (reduce-scatter) of COMMIT rounds (every round in dpu and sync): 'int8' sends
    blockwise int8 values and one fp32 scale per block (``acco_ds.ops.quantize``), summed in fp32 by the owner;
    'int4' values in [-7, 7], two per byte."""

    peek: Literal["none", "int8", "int4"] = "none"
    """The gradient exchange of acco's PEEK rounds (the g~ of the estimate; the commit reuses what it received)."""

    block_size: int = 256
    """Elements per quantization block (one fp32 scale each), counted inside each rank's shard of the buffer."""

    error_feedback: bool = True
    """Each rank adds what quantization lost in its last compressed round (a residual, one buffer of the
    gradient buffer's size and dtype) to the next one, so nothing is lost over rounds, only delayed."""

    all_gather: Literal["none", "int8", "int4"] = "none"
    """The parameter all-gather of every round: 'int8' sends the blockwise int8 difference between each rank's
    new parameters and what every replica already holds; every rank applies the same dequantized difference,
    so the replicas stay bitwise identical and trail the fp32 master by at most half a quantization step."""

    fuse_round_end: bool = True
    """Quantize a compressed round's gradients in its last micro-batch's gradient hooks, each parameter's blocks as
    its gradient arrives (``acco_ds.core.fused_round_end``), rather than in a separate pass of the round's job:
    the same bits, one read and one write of the gradient buffer fewer. Applies where the round's end is known
    before that backward (fixed accumulation); adaptive rounds always quantize in their job. ``false`` keeps the
    separate pass everywhere (to measure the difference)."""

    _choice = field_validator("commit", "peek", "all_gather", mode="before")(classmethod(_string))

    @field_validator("block_size", mode="before")
    @classmethod
    def _block_size(cls, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
            raise ValueError("must be an integer")
        if not 1 <= int(v) <= MAX_BLOCK_SIZE:
            raise ValueError(f"must be in [1, {MAX_BLOCK_SIZE}]")
        return int(v)

    _bool = field_validator("error_feedback", "fuse_round_end", mode="before")(classmethod(_strict_bool))

    @property
    def compresses_gradients(self) -> bool:
        """Whether any round's gradient exchange is compressed (the error-feedback residuals exist)."""
        return self.commit != "none" or self.peek != "none"

    @property
    def enabled(self) -> bool:
        """Whether any round compresses anything."""
        return self.compresses_gradients or self.all_gather != "none"


class MemoryStateConfig(BaseModel):
    """``optimizer.params.memory_state``: each rank's committed optimizer state kept in its node's memory after
    every commit (``acco_ds.core.commit_records``), so that a restarted process resumes without a disk checkpoint
    (docs/RELIABILITY.md, "A crashed process"). Off by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    """Keep the records (about 12 bytes per trainable parameter / data-parallel ranks, twice, per rank)."""

    dir: str = "/dev/shm/acco_ds"
    """The folder of the records: in a memory file system (tmpfs), so that they outlive the process, not the node."""

    peer_copy: bool = True
    """Copy each rank's records into the memory of a rank on another node after every step (``core.peer_copies``;
    the node layout is the launcher's), so that a lost node costs at most one step. One node: no copies."""

    peer_copy_form: Literal["inputs", "state"] = "inputs"
    """What a copy sends after a commit: "inputs", the commit's reduced gradient shard and its step scalars, with which
    the holder steps its copy with the host AdamW (the bits of the rank's own step; a third of the state's bytes in
    fp32), checked against a digest of the rank's result (a mismatch switches that rank's copies to "state"); or
    "state", the fp32 master shard and both moments. Commits whose step is not the plain AdamW (gradients compressed
    and read unsummed, compressed parameters, offload) and the first copy of a process are sent as the state."""

    run_id: str | None = None
    """The run the records belong to (a folder under ``dir``); None: the launcher's ``TORCHELASTIC_RUN_ID``
    (torchrun sets it; every restart of one run shares it), else 'local'."""

    _bool = field_validator("enabled", "peer_copy", mode="before")(classmethod(_strict_bool))

    @field_validator("dir", mode="before")
    @classmethod
    def _dir(cls, v):
        if not isinstance(v, str) or not v.startswith("/"):
            raise ValueError("must be an absolute path")
        return v

    @field_validator("run_id", mode="before")
    @classmethod
    def _run_id(cls, v):
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise ValueError("must be null or a non-empty string")
        return v

    def resolved_run_id(self) -> str:
        """:attr:`run_id`, else the launcher's run id, else 'local'."""
        return self.run_id or os.environ.get("TORCHELASTIC_RUN_ID") or "local"


def _number(v) -> float:
    """A finite real number (int or float; JSON numbers and numeric strings), never a bool."""
    if isinstance(v, bool):
        raise ValueError("must be a number, not a boolean")
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise ValueError("must be a number") from None
    if not isinstance(v, (int, float)):
        raise ValueError(f"must be a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError("must be finite")
    return v


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def local_ranks() -> int:
    """The ranks on this node, as the launcher says: ``LOCAL_WORLD_SIZE`` (torchrun, accelerate), else
    ``LOCAL_SIZE`` (DeepSpeed's launcher), else 1 (a value that is not a positive integer counts as absent)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.strip().isdigit() and int(value) >= 1:
            return int(value)
    return 1


class ACCOConfig(BaseModel):
    """The ``optimizer.params`` of a DeepSpeed config whose optimizer type is ``ACCO``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(1e-3, description="AdamW learning rate (the LR scheduler of the config overrides it).")
    """AdamW learning rate (default 1e-3, DeepSpeed AdamW's); a DeepSpeed/HF scheduler drives it per
    committed optimizer step."""

    betas: Tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1) (default (0.9, 0.999), DeepSpeed AdamW's)."""

    eps: float = 1e-8
    """AdamW epsilon, added to sqrt(v_hat); must be > 0 (default 1e-8, DeepSpeed AdamW's)."""

    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW), >= 0 (default 0, DeepSpeed AdamW's). Per-group values passed in
    model_parameters win."""

    mode: Literal["acco", "dpu", "sync"] = "acco"
    """acco: two-stage delay-compensated pipeline. dpu: delayed parameter update (one-round-stale
    gradients, the baseline ACCO fixes). sync: no overlap, exactly DeepSpeed ZeRO-1."""

    accumulation: Literal["fixed", "adaptive"] = "fixed"
    """fixed: every round takes exactly its share of micro-batches (GAS/2 in acco, GAS in dpu/sync).
    adaptive: a round takes at least its share and keeps accumulating until the communication of
    the previous round is done (acco and dpu only)."""

    comm_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """dtype of the gradient communication buffer (accumulation, reduce-scatter). auto: the model's
    parameter dtype (bf16 or fp16 when the config enables it, else fp32), as DeepSpeed does. fp16 and bf16 do not
    mix: an fp16 model communicates in fp16 or fp32."""

    max_micro_batches_per_round: int | None = None
    """adaptive only: upper bound on the micro-batches one round may accumulate before the compute
    waits for the communication (None: no bound)."""

    comm_timeout_s: float = 300.0
    """Seconds a rank waits for the communication of a round, or for its peers in ACCO's own
    collectives, before raising an error that names the job and the lost peer (docs/RELIABILITY.md);
    also the timeout of ACCO's process groups, and a tenth of it (within [0.2, 5] s) is the heartbeat
    period used to name the lost rank. DeepSpeed's own collectives keep the default group's timeout."""

    host_threads: Union[Literal["auto"], int] = "auto"
    """OpenMP threads of the CPU kernels the round's job runs on the communication worker thread: the host AdamW of
    optimizer offload on GPU ranks (``core.host_step``), and on CPU ranks the job's AdamW, quantization and
    quantized-sum kernels. An integer is used as it is. 'auto' (:meth:`host_thread_count`): on GPU ranks
    ``max(1, CPUs this process may run on // ranks on this node - 1)``, the rank's share of the cores less one
    for its training thread, which keeps enqueueing the next micro-batch's kernels meanwhile (NCCL's proxy thread
    shares the rest); on CPU ranks ``torch.get_num_threads()``, as before the option existed (the launchers already
    give each rank its share of the cores, and its training thread computes on the same threads). The kernels' bits
    do not depend on the count. The training thread's own kernels keep ``torch.get_num_threads()``."""

    peek_lr_scale: float = 1.0
    """acco: the factor on the learning rate of the PEEK, the step that computes the estimate theta~^{t+1} (1.0: the
    paper's estimate, Opt_peek with the commit's settings). A factor s > 1 places the estimate (s - 1) steps beyond the
    next committed parameters along the half-batch step, so the g~ half of every commit is a gradient computed ahead
    (docs/ALGORITHM.md, "The estimate's step"); the commits themselves keep the schedule's LR."""

    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    """Compressed gradient exchange with error feedback (CPU/gloo ranks; ``CompressionConfig``). Off by default."""

    memory_state: MemoryStateConfig = Field(default_factory=MemoryStateConfig)
    """The committed state kept in node memory for a restart without a disk checkpoint (``MemoryStateConfig``)."""

    # -- field checks: each names what is allowed (ALLOWED); from_params adds the key and the value --
    @field_validator("lr", "weight_decay", mode="before")
    @classmethod
    def _non_negative(cls, v):
        v = _number(v)
        if not v >= 0.0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("eps", mode="before")
    @classmethod
    def _positive(cls, v):
        v = _number(v)
        if not v > 0.0:
            raise ValueError("must be > 0")
        return v

    @field_validator("betas", mode="before")
    @classmethod
    def _betas(cls, v):
        if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__len__") or len(v) != 2:
            raise ValueError("must be a pair [beta1, beta2]")
        out = []
        for i, b in enumerate(v):
            try:
                b = _number(b)
            except ValueError as err:
                raise ValueError(f"betas[{i}]={b!r} {err}") from None
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}]={b!r} is outside [0, 1)")
            out.append(b)
        return tuple(out)

    @field_validator("max_micro_batches_per_round", mode="before")
    @classmethod
    def _max_mb(cls, v):
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
            raise ValueError("must be an integer")
        if int(v) < 1:
            raise ValueError("must be >= 1")
        return int(v)

    @field_validator("comm_timeout_s", mode="before")
    @classmethod
    def _timeout(cls, v):
        v = _number(v)
        if not MIN_TIMEOUT_S <= v <= MAX_TIMEOUT_S:
            raise ValueError(f"must be in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] seconds")
        return v

    @field_validator("host_threads", mode="before")
    @classmethod
    def _host_threads(cls, v):
        if v == "auto" and isinstance(v, str):
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
            raise ValueError("must be 'auto' or an integer")
        if not 1 <= int(v) <= MAX_HOST_THREADS:
            raise ValueError(f"must be in [1, {MAX_HOST_THREADS}]")
        return int(v)

    @field_validator("peek_lr_scale", mode="before")
    @classmethod
    def _peek_lr_scale(cls, v):
        v = _number(v)
        if not 0.0 < v <= MAX_PEEK_LR_SCALE:
            raise ValueError(f"must be in (0, {MAX_PEEK_LR_SCALE:g}]")
        return v

    _choice = field_validator("mode", "accumulation", "comm_dtype", mode="before")(classmethod(_string))

    @model_validator(mode="after")
    def _combinations(self) -> ACCOConfig:
        if self.mode == "sync" and self.accumulation == "adaptive":
            raise _ComboError(
                "accumulation",
                "adaptive",
                "adaptive accumulation needs communication that overlaps the compute and mode='sync' has "
                "none. Allowed: 'fixed' with mode='sync'; or mode='acco' / 'dpu' with 'adaptive'.",
            )
        if self.compression.peek != "none" and self.mode != "acco":
            raise _ComboError(
                "compression.peek",
                self.compression.peek,
                f"mode={self.mode!r} has no peek round to compress. Allowed: 'none' with mode='dpu' or 'sync' "
                "(compression.commit compresses their rounds); 'int8' or 'int4' with mode='acco'.",
            )
        if self.peek_lr_scale != 1.0 and self.mode != "acco":
            raise _ComboError(
                "peek_lr_scale",
                self.peek_lr_scale,
                f"mode={self.mode!r} has no peek (its rounds commit). Allowed: 1.0 with mode='dpu' or 'sync'; any "
                f"value in (0, {MAX_PEEK_LR_SCALE:g}] with mode='acco'.",
            )
        if self.accumulation == "fixed" and self.max_micro_batches_per_round is not None:
            raise _ComboError(
                "max_micro_batches_per_round",
                self.max_micro_batches_per_round,
                "applies to accumulation='adaptive' only (accumulation='fixed' here). Allowed: null with "
                "'fixed'; remove it, or set accumulation='adaptive'.",
            )
        return self

    def host_thread_count(
        self, device_type: str, cpus: int | None = None, ranks_on_node: int | None = None
    ) -> int | None:
        """The threads :attr:`host_threads` gives the round job's CPU kernels on a rank whose parameters are on a
        ``device_type`` device ('cpu', 'cuda', ...): the integer set, else ('auto') None on CPU ranks (the kernels
        then take ``torch.get_num_threads()``) and ``max(1, cpus // ranks_on_node - 1)`` on the others. ``cpus``
        defaults to :func:`available_cpus`, ``ranks_on_node`` to :func:`local_ranks`."""
        if self.host_threads != "auto":
            return self.host_threads
        if device_type == "cpu":
            return None
        cpus = available_cpus() if cpus is None else cpus
        ranks = local_ranks() if ranks_on_node is None else ranks_on_node
        return max(1, cpus // max(1, ranks) - 1)

    def adamw_settings(self):
        """The config's AdamW settings as ``acco_ds.ops.adamw_settings.AdamWSettings``: the defaults of every
        parameter group (a group's own values, and then the LR scheduler, win)."""
        from acco_ds.ops.adamw_settings import AdamWSettings  # acco_ds.ops imports torch; the config does not

        return AdamWSettings.from_torch(self.lr, self.betas, self.eps, self.weight_decay)

    @classmethod
    def from_params(cls, params: dict | None) -> ACCOConfig:
        """Build from the config's ``optimizer.params``. Raise ACCOConfigError (and nothing else) with one
        message listing every problem found, each as ``optimizer.params.<key>=<value>: <what is wrong>.
        Allowed: <what is allowed>``."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ACCOConfigError(
                f"Invalid ACCO optimizer config:\n  optimizer.params={params!r}: must be a JSON object "
                f'(a dict of options), got {type(params).__name__}. Allowed: {{"lr": 0.001, "mode": "acco", ...}} '
                f"with keys among {', '.join(sorted(cls.model_fields))}."
            )
        try:
            return cls(**{str(k): v for k, v in params.items()})
        except _ComboError as err:  # raised directly when pydantic does not wrap it
            raise ACCOConfigError(f"Invalid ACCO optimizer config:\n  {err.line()}") from None
        except ValidationError as err:
            lines = []
            for e in err.errors():
                loc = e["loc"]
                key = str(loc[0]) if loc else ""
                combo = (e.get("ctx") or {}).get("error")
                if isinstance(combo, _ComboError):
                    lines.append(combo.line())
                elif key in SECTIONS and len(loc) > 1:
                    sub = str(loc[1])
                    given = params.get(key)
                    value = given.get(sub) if isinstance(given, dict) else None
                    msg = e["msg"].removeprefix("Value error, ")
                    if e["type"] == "extra_forbidden":
                        allowed = ", ".join(sorted(SECTIONS[key].model_fields))
                        lines.append(
                            f"optimizer.params.{key}.{sub}={value!r}: unknown option. Allowed keys: {allowed}."
                        )
                        continue
                    if e["type"] == "literal_error":
                        msg = "unknown value"
                    lines.append(
                        f"optimizer.params.{key}.{sub}={value!r}: {msg}. "
                        f"Allowed: {ALLOWED.get(key + '.' + sub, ALLOWED[key])}."
                    )
                elif e["type"] == "extra_forbidden":
                    allowed = ", ".join(sorted(cls.model_fields))
                    lines.append(
                        f"optimizer.params.{key}={params.get(key)!r}: unknown option. Allowed keys: {allowed}."
                    )
                elif key in cls.model_fields:
                    msg = e["msg"].removeprefix("Value error, ")
                    if e["type"] == "literal_error":
                        msg = "unknown value"
                    lines.append(
                        f"optimizer.params.{key}={params.get(key)!r}: {msg}. Allowed: {ALLOWED[key]}."
                    )
                else:
                    lines.append(f"optimizer.params: {e['msg'].removeprefix('Value error, ')}")
            raise ACCOConfigError("Invalid ACCO optimizer config:\n  " + "\n  ".join(lines)) from None


SECTIONS = {  # the sub-sections of optimizer.params, by key
    "compression": CompressionConfig,
    "memory_state": MemoryStateConfig,
}
