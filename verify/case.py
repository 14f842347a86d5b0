"""Case: the one frozen, JSON-round-trippable description of a run.

Everything a run does follows from its Case (model, wrap plan, world size, precision, optimizer,
steps, data, seeds, engine); nothing from globals. Its content hash names caches and repro files.
Validation happens on construction and names the offending field and what was expected, so a bad
`--case FILE` fails with exit code 2 before any process is started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from fsdp_verify import dtypes, units
from fsdp_verify.dims import registry
from fsdp_verify.dims.parallel_dims import ParallelDims
from fsdp_verify.dims.registry import DimSpecs
from fsdp_verify.dims.together import check_together
from fsdp_verify.models import ModelSpec, default_wrap_plan, module_classes
from fsdp_verify.models.spec import IMPORT_PATH, is_import_path
from fsdp_verify.validation import CaseError, check, is_int, is_number

OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "rmsprop")
# Learning-rate schedules (torch.optim.lr_scheduler), stepped once after every optimizer step.
SCHEDULES = ("exponential", "linear_warmup")
DATA_KINDS = ("normal", "cancellation")
GRAD_REDUCTIONS = ("avg", "sum")  # Case.grad_reduction
INIT_MODES = ("eager", "meta")
# torch.compile (docs/compile.md): what is compiled (Case.compile) and by which backend.
# "units": each unit but the root; "blocks": each unit that is a repeated block (an element of a
# module list or dict, verify/units.py `is_block`: torchtitan's `apply_compile`); "model": the root.
COMPILE_SCOPES = ("units", "model", "blocks")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class PrecisionSpec:
    """FSDP2 MixedPrecisionPolicy fields by dtype name; None means "as the parameter" (fp32).
    Any spelling `fsdp_verify.dtypes` accepts is stored as its short name (`bfloat16` -> `bf16`)."""

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    output_dtype: str | None = None
    cast_forward_inputs: bool = True

    DTYPE_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype")

    def __post_init__(self) -> None:
        for name in self.DTYPE_FIELDS:
            with contextlib.suppress(ValueError):  # an unknown name stays; validate() names the field
                object.__setattr__(self, name, dtypes.canonical_or_none(getattr(self, name)))

    def validate(self, prefix: str = "precision") -> None:
        for name in self.DTYPE_FIELDS:
            value = getattr(self, name)
            check(value is None or value in dtypes.NAMES, f"{prefix}.{name}", f"null or {dtypes.ACCEPTED}", value)

    @property
    def is_full_precision(self) -> bool:
        return all(d in (None, "fp32") for d in (self.param_dtype, self.reduce_dtype, self.output_dtype))

    @property
    def uses_fp16(self) -> bool:
        """Whether any of the dtypes is fp16: what dynamic loss scaling is for."""
        return "fp16" in (self.param_dtype, self.reduce_dtype, self.output_dtype)

    def describe(self) -> str:
        """`fp32`, or e.g. `param bf16, reduce fp32`: the fields that are set, short names."""
        if self.is_full_precision:
            return "fp32"
        parts = [f"{n.removesuffix('_dtype')} {getattr(self, n)}" for n in self.DTYPE_FIELDS if getattr(self, n)]
        return ", ".join(parts)


@dataclass(frozen=True)
class OptimSpec:
    name: str = "adamw"
    lr: float = 1e-2
    momentum: float = 0.9  # sgd, rmsprop
    weight_decay: float = 0.01  # sgd, adamw, adagrad, rmsprop
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    # ---- optimizers and schedules (docs/optimizers-and-schedules.md) ----
    # Adam(W) keeping the running max of its second moment (state `max_exp_avg_sq`).
    amsgrad: bool = False
    # None: a constant rate. "exponential": lr * factor**k after k steps (ExponentialLR, gamma =
    # factor); "linear_warmup": from lr * factor up to lr over the case's steps (LinearLR,
    # start_factor = factor). Either way the rate changes every step.
    schedule: str | None = None
    schedule_factor: float = 0.5

    # Left out of the JSON (and so of the hash) while at their defaults: a case keeps its hash.
    OPTIONAL_FIELDS = ("amsgrad", "schedule", "schedule_factor")

    def validate(self, prefix: str = "optim") -> None:
        check(self.name in OPTIMIZERS, f"{prefix}.name", f"one of {OPTIMIZERS}", self.name)
        check(isinstance(self.amsgrad, bool), f"{prefix}.amsgrad", "true or false", self.amsgrad)
        check(
            not self.amsgrad or self.name in ("adam", "adamw"),
            f"{prefix}.amsgrad",
            f"false unless the optimizer is adam or adamw (not {self.name})",
            self.amsgrad,
        )
        check(
            self.schedule is None or self.schedule in SCHEDULES,
            f"{prefix}.schedule",
            f"null or one of {SCHEDULES}",
            self.schedule,
        )
        check(
            is_number(self.schedule_factor) and 0 < self.schedule_factor <= 1,
            f"{prefix}.schedule_factor",
            "a factor in (0, 1]",
            self.schedule_factor,
        )
        check(is_number(self.lr) and self.lr > 0, f"{prefix}.lr", "a positive learning rate", self.lr)
        check(
            is_number(self.momentum) and 0 <= self.momentum < 1,
            f"{prefix}.momentum",
            "a value in [0, 1)",
            self.momentum,
        )
        check(
            is_number(self.weight_decay) and self.weight_decay >= 0,
            f"{prefix}.weight_decay",
            "a non-negative value",
            self.weight_decay,
        )
        check(
            len(self.betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in self.betas),
            f"{prefix}.betas",
            "two values in [0, 1)",
            self.betas,
        )
        check(is_number(self.eps) and self.eps > 0, f"{prefix}.eps", "a positive value", self.eps)


@dataclass(frozen=True)
class DataSpec:
    """Global batch per step. `cancellation` pairs samples x and -x + small noise across ranks so
    per-rank gradients are large and nearly cancel: a reduction in too low a precision loses them."""

    batch_size: int = 8
    kind: str = "normal"
    scale: float = 1.0
    # Token models: each sequence gets its own length in [1, seq_len], padded with ignore_index,
    # so ranks and micro-batches hold different numbers of real tokens (loss normalisation).
    padded: bool = False
    # A user's `fn(case, step, generator) -> (inputs, targets)` for the global batch.
    fn: str | None = None

    OPTIONAL_FIELDS = ("padded", "fn")

    def validate(self, prefix: str = "data") -> None:
        check(isinstance(self.padded, bool), f"{prefix}.padded", "true or false", self.padded)
        check(self.fn is None or is_import_path(self.fn), f"{prefix}.fn", f"null or {IMPORT_PATH}", self.fn)
        check(
            is_int(self.batch_size) and self.batch_size >= 1,
            f"{prefix}.batch_size",
            "a positive integer",
            self.batch_size,
        )
        check(self.kind in DATA_KINDS, f"{prefix}.kind", f"one of {DATA_KINDS}", self.kind)
        check(is_number(self.scale) and self.scale > 0, f"{prefix}.scale", "a positive value", self.scale)


@dataclass(frozen=True)
class LossScaleSpec:
    """fp16 dynamic loss scaling (seed 002), as `GradScaler` takes it: the loss is multiplied by
    the scale before backward, the gradients divided by it before clipping; a step whose
    gradients hold an inf or NaN on any rank is skipped on every rank and the scale multiplied by
    `backoff_factor`; after `growth_interval` steps in a row without one it is multiplied by
    `growth_factor`."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def scaler_kwargs(self) -> dict[str, float | int]:
        """The keyword arguments of `torch.amp.GradScaler` and `ShardedGradScaler` (one spelling
        for every scaler the engines and the zoo build)."""
        return {
            "init_scale": self.init_scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def describe(self) -> str:
        """e.g. `loss scale 65536 (x2 after 2000 good steps, x0.5 on inf/NaN)`."""
        return (
            f"loss scale {self.init_scale:.10g} (x{self.growth_factor:g} after {self.growth_interval} good steps,"
            f" x{self.backoff_factor:g} on inf/NaN)"
        )

    def validate(self, prefix: str = "loss_scaling") -> None:
        check(
            is_number(self.init_scale) and 0 < self.init_scale < float("inf"),
            f"{prefix}.init_scale",
            "a positive finite scale",
            self.init_scale,
        )
        check(
            is_number(self.growth_factor) and self.growth_factor > 1,
            f"{prefix}.growth_factor",
            "a factor above 1",
            self.growth_factor,
        )
        check(
            is_number(self.backoff_factor) and 0 < self.backoff_factor < 1,
            f"{prefix}.backoff_factor",
            "a factor in (0, 1)",
            self.backoff_factor,
        )
        check(
            is_int(self.growth_interval) and self.growth_interval >= 1,
            f"{prefix}.growth_interval",
            "a positive integer",
            self.growth_interval,
        )


# What a resume resumes on (None: as before), beside `resume_after` (None: no resume).
RESUMED_ON = ("resume_world_size", "resume_mesh_shape", "resume_engine", "resume_tp", "resume_ep", "resume_pp")


# Losses (by their import path: data, nothing imported to know it) that are the summed next-token
# cross-entropy and take vocabulary-sharded logits themselves, with the arithmetic the reference
# emulates for loss parallelism (reference/tensor_parallel.py `vocab_parallel_cross_entropy`):
# torchtitan's `cross_entropy_loss` (its `_LossParallelCrossEntropy`: the max, the sum of
# exponentials and the target's log-probability all-reduced, the same fused backward).
VOCABULARY_PARALLEL_LOSSES = ("fsdp_verify.frameworks.torchtitan:loss",)


@dataclass(frozen=True)
class Case:
    model: ModelSpec = field(default_factory=ModelSpec)
    # Module FQNs to shard, children before parents, "" (the root) last. None = the model's
    # default plan (every block, then the root).
    wrap: tuple[str, ...] | None = None
    world_size: int = 2
    mesh_shape: tuple[int, ...] | None = None  # None = (world_size,); (replicate, shard) = HSDP
    precision: PrecisionSpec = field(default_factory=PrecisionSpec)
    reshard_after_forward: bool | int = True
    optim: OptimSpec = field(default_factory=OptimSpec)
    steps: int = 3
    microbatches: int = 1
    # True: reduce-scatter after every micro-batch (FSDP2 default). False: accumulate unsharded
    # grads locally (in param_dtype) and reduce only on the last micro-batch, as seed 000 describes.
    sync_every_microbatch: bool = True
    clip_norm: float | None = None
    data: DataSpec = field(default_factory=DataSpec)
    seed: int = 0
    data_seed: int = 1
    init: str = "eager"
    engine: str = "fsdp2"
    # A user's `loss(logits, targets) -> sum over items`; divided by the global count of
    # targets that are not ignore_index (-100). None: next-token cross-entropy (token models).
    loss: str | None = None
    # A user's training step `NAME(model, optimizer, batch, ctx) -> loss` run unchanged on both
    # sides (verify/training/user_step.py) instead of the toolkit's own loop. None: the toolkit's.
    step: str | None = None
    # Activation checkpointing (torch.utils.checkpoint, RNG state preserved) on every wrapped unit
    # but the root: recomputation in backward must replay the forward's dropout masks.
    activation_checkpointing: bool = False
    # Dynamic loss scaling on both sides (a ShardedGradScaler on the sharded one); None: none.
    loss_scaling: LossScaleSpec | None = None
    # Zoom (verify/zoom/): per-module probes at one step, "STEP"; or the ops inside one module's
    # forward or backward, "STEP/forward/FQN" or "STEP/backward/FQN". None: an ordinary run.
    zoom: str | None = None

    # ---- fully_shard's knobs (issue 28, items 1-4) ----
    # `offload_policy=CPUOffloadPolicy(pin_memory=False)`: sharded parameters, gradients and the
    # optimizer step on the CPU, each unit's parameters all-gathered on the compute device.
    # Numbers unchanged (the same arithmetic on the same values); what is held where changes.
    offload: bool = False
    # `shard_placement_fn`: dim0 (Shard(0), FSDP2's default), dim1 (Shard(1) where the shard
    # group divides dim 1) or mixed (some of those Shard(1), the rest Shard(0), per unit);
    # verify/engines/placement.py. Changes the reduce-scatter's layout, so its summation order.
    shard_placement: str = "dim0"
    # HSDP accumulation: `set_requires_all_reduce(False)` before every micro-batch but the last,
    # so each replica reduce-scatters every micro-batch and the replicas all-reduce once, on the
    # last (FSDP2 keeps the partial sums in reduce_dtype meanwhile). A 1-D mesh has no replicas.
    replica_sync_last: bool = False
    # Accumulation that keeps parameters unsharded: `set_reshard_after_backward(False)` before
    # every micro-batch but the last, so a unit's backward leaves it unsharded and the next
    # micro-batch's forward all-gathers nothing for it (True again on the last, so the optimizer
    # steps sharded parameters). Numbers unchanged; traffic and what is held between change.
    reshard_after_backward_last: bool = False
    # How the data-parallel ranks' gradients are combined: "avg" (FSDP2's default ReduceOp.AVG)
    # or "sum" (`set_gradient_divide_factor(1.0)` on every unit, the legitimate use: FSDP2 sums
    # over the shard group and the replicas, and the loop divides each rank's loss by the
    # data-parallel world size, so the update is the average's). Changes the rounding only.
    grad_reduction: str = "avg"
    # `fully_shard(..., ignored_params=...)`: the parameters these name (prefixes, as
    # `model.frozen`) stay unsharded, unreduced and unmanaged on every rank; the loop all-reduces
    # their gradients itself after the last micro-batch's backward (SUM, then / W under avg), as a
    # user keeping a small replicated module does. A frozen one gets no gradient to reduce.
    ignored: tuple[str, ...] = ()
    # Explicit prefetching: each unit's `set_modules_to_forward_prefetch` / `..._backward_prefetch`
    # lists the next k units of that pass (verify/engines/prefetch.py: forward order, and the
    # reverse of the post-forward order). None: FSDP2's implicit prefetching only. Numbers
    # unchanged; which units are all-gathered in backward and what is held at once change.
    prefetch: int | None = None

    # What is trained changes (docs/optimizers-and-schedules.md): the parameters `model.frozen`
    # names are frozen for the steps before this one and trained from it on (a fine-tuning
    # recipe; a unit's first forward may run frozen). None: frozen throughout.
    unfreeze_step: int | None = None

    # A checkpoint and resume (docs/resume.md): the sharded run saves after step `resume_after`
    # (torch.distributed.checkpoint), stops, and a new run resumes from it on `resume_world_size`
    # ranks (mesh `resume_mesh_shape`) with `resume_engine`, the tp degree `resume_tp`, the
    # expert-parallel degree `resume_ep` and the pipeline degree `resume_pp`; None: as before. The
    # reference is the same run never stopped. None: no resume.
    resume_after: int | None = None
    resume_world_size: int | None = None
    resume_mesh_shape: tuple[int, ...] | None = None
    resume_engine: str | None = None
    resume_tp: int | None = None
    resume_ep: int | None = None
    resume_pp: int | None = None

    # Expert parallelism (docs/expert-parallel.md): the grouped experts (`model.top_k`) sharded
    # over an `ep` mesh dim of this many ranks, carved out of the shard dim, tokens moved by
    # all-to-all; FSDP shards the dense parameters over every data-parallel rank and the experts
    # over what is left (torchtitan's order). 1: every rank holds every expert.
    ep: int = 1

    # Pipeline parallelism (docs/pipeline-parallel.md): the model split into stages over a "pp"
    # mesh dim of this many ranks, outermost; `world_size` counts every rank (pp x the
    # data-parallel ranks) and `mesh_shape` is the data-parallel part. 1: none.
    pp: int = 1
    # torch.distributed.pipelining's schedule: "gpipe", "1f1b", or "interleaved1f1b" (two stages a rank).
    pp_schedule: str = "1f1b"
    # The stages: None = the built-in model's blocks split evenly; "pkg.module:NAME" or
    # "file.py:NAME" = fn(model, n_stages) -> the stage modules (a user's code: verify/trust.py).
    pp_split: str | None = None
    # The schedule's `scale_grads`: true (torch's default), it divides the reduced gradients by the
    # micro-batches once all have run, and each micro-batch's loss is scaled up by their count;
    # false (torchtitan's schedule), each micro-batch's loss is its share of the step's as it is.
    pp_scale_grads: bool = True
    # torch.compile (docs/compile.md), applied by the engine in place (`module.compile()`, FQNs
    # kept) after activation checkpointing and before fully_shard, torchtitan's order: None, "units"
    # (each unit of the wrap plan but the root) or "model" (the whole model); the reference is
    # compiled alike. `compile_fullgraph`: a graph break is an error; `compile_backend`: inductor,
    # aot_eager (Dynamo and AOTAutograd, no code generation) or eager (Dynamo alone).
    compile: str | None = None
    compile_fullgraph: bool = False
    compile_backend: str = "inductor"

    # ---- tensor parallelism (docs/tensor-parallel.md) ----
    # The tp degree: `world_size` counts every rank, data-parallel ranks times `tp`; the ranks form
    # the mesh `mesh + (tp,)`, its dims named ("shard", "tp") or ("replicate", "shard", "tp"), and
    # `mesh_shape` is the data-parallel part. The engine applies the plan over "tp" first, then
    # `fully_shard` over the data-parallel dims (torchtitan's order). 1: no tensor parallelism.
    tp: int = 1
    # The plan (verify/engines/tensor_parallel.py): None = the built-in model's, or a transformers
    # model's own `base_model_tp_plan`; "pkg.module:NAME" / "file.py:NAME" = a dict of module FQN to
    # ParallelStyle, or a function (model, tp_mesh) returning one (a user's code: verify/trust.py).
    tp_plan: str | None = None
    # The built-in Transformer's plan with sequence parallelism (norms on sequence shards) and
    # with loss parallelism (the head's output left sharded over the vocabulary, the
    # cross-entropy computed under `loss_parallel()`).
    sequence_parallel: bool = False
    loss_parallel: bool = False

    # ---- the registered dimension packages (verify/dims/registry.py) ----
    # Each package's spec, off by default (`case.dims.float8`); a case file holds only those on.
    dims: DimSpecs = field(default_factory=DimSpecs)

    OPTIONAL_FIELDS = (
        "loss",
        "step",
        "activation_checkpointing",
        "loss_scaling",
        "offload",
        "shard_placement",
        "replica_sync_last",
        "reshard_after_backward_last",
        "grad_reduction",
        "ignored",
        "prefetch",
        "zoom",
        "unfreeze_step",
        "resume_after",
        *RESUMED_ON,
        "ep",
        "pp",
        "pp_schedule",
        "pp_split",
        "pp_scale_grads",
        "compile",
        "compile_fullgraph",
        "compile_backend",
        "tp",
        "tp_plan",
        "sequence_parallel",
        "loss_parallel",
    )

    def __post_init__(self) -> None:
        self.validate()

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        self.model.validate()
        self.precision.validate()
        self.optim.validate()
        self.data.validate()
        check(is_int(self.world_size) and self.world_size >= 1, "world_size", "a positive integer", self.world_size)
        check(is_int(self.tp) and self.tp >= 1, "tp", "a positive integer (1: no tensor parallelism)", self.tp)
        check(
            self.world_size % self.tp == 0,
            "world_size",
            f"a multiple of tp={self.tp} (every rank: data-parallel ranks times tp)",
            self.world_size,
        )
        self._validate_zoom()
        mesh = self.mesh
        check(
            len(mesh) in (1, 2) and all(is_int(d) and d >= 1 for d in mesh),
            "mesh_shape",
            "(shard,) or (replicate, shard) of positive integers",
            self.mesh_shape,
        )
        prod = 1
        for d in mesh:
            prod *= d
        check(is_int(self.pp) and self.pp >= 1, "pp", "a positive integer (1: no pipeline parallelism)", self.pp)
        check(
            self.world_size % self.pp == 0,
            "world_size",
            f"a multiple of pp={self.pp} (every rank: the stages times the data-parallel ranks)",
            self.world_size,
        )
        check(
            prod == self.dp_size,
            "mesh_shape",
            f"dimensions whose product is world_size={self.world_size}"
            + (
                f" / {self._parallel_degrees} = {self.dp_size} (the data-parallel ranks)"
                if self._parallel_degrees
                else ""
            ),
            self.mesh_shape,
        )
        check(is_int(self.steps) and self.steps >= 1, "steps", "a positive integer", self.steps)
        check(
            is_int(self.microbatches) and self.microbatches >= 1,
            "microbatches",
            "a positive integer",
            self.microbatches,
        )
        per = self.dp_size * self.microbatches
        ranks = f"(world_size / {self._parallel_degrees})" if self._parallel_degrees else "world_size"
        check(
            self.data.batch_size % per == 0,
            "data.batch_size",
            f"a multiple of {ranks} * microbatches = {self.dp_size} * {self.microbatches} = {per}",
            self.data.batch_size,
        )
        check(
            self.clip_norm is None or (is_number(self.clip_norm) and self.clip_norm > 0),
            "clip_norm",
            "null or a positive max norm",
            self.clip_norm,
        )
        for name in ("seed", "data_seed"):
            check(
                is_int(getattr(self, name)) and getattr(self, name) >= 0,
                name,
                "a non-negative integer",
                getattr(self, name),
            )
        check(self.init in INIT_MODES, "init", f"one of {INIT_MODES}", self.init)
        check(
            isinstance(self.engine, str) and bool(self.engine),
            "engine",
            "'fsdp2', 'pkg.module:NAME' or 'file.py:NAME'",
            self.engine,
        )
        rsf = self.reshard_after_forward
        check(
            isinstance(rsf, bool) or (is_int(rsf) and rsf >= 1),
            "reshard_after_forward",
            "true, false or a positive int",
            rsf,
        )
        check(self.loss is None or is_import_path(self.loss), "loss", f"null or {IMPORT_PATH}", self.loss)
        check(self.step is None or is_import_path(self.step), "step", f"null or {IMPORT_PATH}", self.step)
        check(
            isinstance(self.activation_checkpointing, bool),
            "activation_checkpointing",
            "true or false",
            self.activation_checkpointing,
        )
        if self.loss_scaling is not None:
            check(
                isinstance(self.loss_scaling, LossScaleSpec),
                "loss_scaling",
                "null or an object with init_scale, growth_factor, backoff_factor, growth_interval",
                self.loss_scaling,
            )
            self.loss_scaling.validate()
            check(
                self.step is None,
                "loss_scaling",
                "null with a user's step (--step scales its own loss, if it does)",
                dataclasses.asdict(self.loss_scaling),
            )
            # Refused, not run: loss scaling guards fp16's narrow range (small gradients flush to
            # zero, large ones overflow); bf16 and fp32 have fp32's exponent range, so in them a
            # scaler only multiplies and divides by powers of two and the check would test nothing
            # a user asked about. fuzz and sweep draw it for fp16 cases only, likewise.
            check(
                self.precision.uses_fp16,
                "loss_scaling",
                "null unless the case computes in fp16 (precision.param_dtype, reduce_dtype or output_dtype"
                " fp16): dynamic loss scaling is for fp16's range; bf16 and fp32 need none (--loss-scaling off)",
                f"{self.loss_scaling.describe()} with precision {self.precision.describe()}",
            )
        self._validate_shard_knobs()
        self._validate_ignored()
        self._validate_experts_trainable()
        self._validate_unfreeze()
        self._validate_resume()
        self._validate_custom()
        self._validate_wrap()
        self._validate_checkpointing()
        self._validate_modelled_together()
        self._validate_dims()
        from fsdp_verify.engines.expert_parallel import check_experts

        check_experts(self)
        from fsdp_verify.engines.pipeline_parallel import check_pipeline

        check_pipeline(self)
        self._validate_tp()
        self._validate_compile()
        if self.data.kind == "cancellation":
            check(
                self.model.kind == "mlp",
                "data.kind",
                "'normal' for a transformer (token ids cannot cancel)",
                self.data.kind,
            )

    def _validate_shard_knobs(self) -> None:
        """fully_shard's knobs (issue 28): offload and per-parameter placements."""
        from fsdp_verify.engines.placement import PLACEMENTS

        check(isinstance(self.offload, bool), "offload", "true or false", self.offload)
        check(self.shard_placement in PLACEMENTS, "shard_placement", f"one of {PLACEMENTS}", self.shard_placement)
        check(isinstance(self.replica_sync_last, bool), "replica_sync_last", "true or false", self.replica_sync_last)
        rsf = self.reshard_after_forward
        if self.shard_placement != "dim0" and is_int(rsf) and not isinstance(rsf, bool):
            check(
                not 1 < rsf < self.mesh[-1],
                "shard_placement",
                f"'dim0' with an int reshard_after_forward {rsf} below the shard group {self.mesh[-1]}: FSDP2 (torch"
                " 2.13) crashes resharding a Shard(1) parameter to the smaller group after forward"
                " (tests/upstream/test_fsdp2_shard1_int_reshard_after_forward.py)",
                self.shard_placement,
            )
        if self.replica_sync_last:
            check(
                len(self.mesh) == 2,
                "replica_sync_last",
                "false on a 1-D mesh (no replicas to all-reduce over; set mesh_shape R,S)",
                True,
            )
            check(
                self.step is None,
                "replica_sync_last",
                "false with a user's step (--step calls set_requires_all_reduce itself, if it does)",
                True,
            )
        check(
            isinstance(self.reshard_after_backward_last, bool),
            "reshard_after_backward_last",
            "true or false",
            self.reshard_after_backward_last,
        )
        if self.reshard_after_backward_last:
            check(
                self.step is None,
                "reshard_after_backward_last",
                "false with a user's step (--step calls set_reshard_after_backward itself, if it does)",
                True,
            )
        check(
            self.prefetch is None or (is_int(self.prefetch) and self.prefetch >= 1),
            "prefetch",
            "null (FSDP2's implicit prefetching) or a positive integer (units ahead)",
            self.prefetch,
        )
        # The lists follow registration order; the MLP's routed `moe` runs out of it, so a forward
        # list names a unit that already ran, and what FSDP2 then holds is not modelled (a memory
        # false alarm of 4,624 B against 544 B, seed 7's sweep).
        check(
            self.prefetch is None or not self.model.experts,
            "prefetch",
            "null with routed experts (their unit runs out of registration order: prefetch lists naming a unit"
            " that already ran are not modelled)",
            self.prefetch,
        )
        check(
            self.grad_reduction in GRAD_REDUCTIONS, "grad_reduction", f"one of {GRAD_REDUCTIONS}", self.grad_reduction
        )
        if self.grad_reduction != "avg":
            check(
                self.step is None,
                "grad_reduction",
                "'avg' with a user's step (--step scales its own loss; the toolkit cannot divide it by the world size)",
                self.grad_reduction,
            )

    def _validate_ignored(self) -> None:
        """`ignored` (fully_shard's ignored_params) names parameters, and what FSDP2 leaves to the
        loop for them works: no cast, no clip over them, no resume."""
        from fsdp_verify.models import is_ignored, parameter_names

        ignored = self.ignored
        check(
            isinstance(ignored, tuple) and all(isinstance(n, str) and n for n in ignored),
            "ignored",
            "a list of parameter names (prefixes)",
            ignored,
        )
        if not ignored:
            return
        names = parameter_names(self.model)
        for prefix in ignored:
            check(
                any(is_ignored((prefix,), n) for n in names),
                "ignored",
                f"names of the model's parameters or their modules (tied weights under their first name; {prefix!r}"
                " names none)",
                ignored,
            )
        check(
            not all(is_ignored(ignored, n) for n in names),
            "ignored",
            "to leave FSDP at least one parameter (every parameter ignored: nothing is sharded)",
            ignored,
        )
        check(
            self.step is None,
            "ignored",
            "empty with a user's step (the toolkit's loop all-reduces the ignored gradients)",
            ignored,
        )
        check(
            self.precision.param_dtype in (None, "fp32"),
            "ignored",
            f"empty with param_dtype {self.precision.param_dtype}: FSDP2 does not cast ignored parameters, which stay"
            " fp32 beside low-precision activations",
            ignored,
        )
        check(
            self.clip_norm is None,
            "ignored",
            "empty with clip_norm: torch 2.13's clip_grad_norm_ refuses the ignored parameters' plain gradients"
            " beside DTensor ones ('got mixed torch.Tensor and DTensor')",
            ignored,
        )
        check(
            not self.model.experts,
            "ignored",
            "empty with routed experts (a rank no sample reaches has no gradient to all-reduce: the ranks' calls differ)",
            ignored,
        )

    def _validate_experts_trainable(self) -> None:
        """An expert no sample of a micro-batch reaches takes no part in its graph: with every
        parameter outside the routed experts frozen, such a micro-batch's loss has no gradient at
        all (autograd refuses it on the reference and the ranks alike)."""
        if not self.model.experts or not self.model.frozen:
            return
        from fsdp_verify.models import is_frozen, parameter_names

        outside = [n for n in parameter_names(self.model) if not n.startswith("moe.experts.")]
        check(
            any(not is_frozen(self.model, n) for n in outside),
            "model.frozen",
            "to leave a parameter outside the routed experts trainable (an expert no sample reaches gives a loss"
            " without gradient)",
            self.model.frozen,
        )

    def _validate_unfreeze(self) -> None:
        check(
            self.step is None or self.optim.schedule is None,
            "optim.schedule",
            "null with a user's step (it steps its own optimizer)",
            self.optim.schedule,
        )
        if self.unfreeze_step is None:
            return
        check(
            is_int(self.unfreeze_step) and self.unfreeze_step >= 2,
            "unfreeze_step",
            "null or a step from 2 on (the first step the frozen parameters train)",
            self.unfreeze_step,
        )
        # Named `model.frozen`: a pinned unfreeze step is valid beside a frozen model (`check_field_value`).
        check(bool(self.model.frozen), "model.frozen", f"the parameters to unfreeze at step {self.unfreeze_step}", ())
        check(
            self.step is None, "unfreeze_step", "null with a user's step (it trains what it trains)", self.unfreeze_step
        )

    def _validate_resume(self) -> None:
        """A resume needs a step to save after and a step after it; what it resumes on must be a
        valid case of its own (the batch divisible by its ranks, the model by its tp degree)."""
        if self.resume_after is None:
            for name in RESUMED_ON:
                check(getattr(self, name) is None, name, "null without resume_after", getattr(self, name))
            return
        check(
            is_int(self.resume_after) and 1 <= self.resume_after < self.steps,
            "resume_after",
            f"a step in [1, steps - 1] = [1, {self.steps - 1}] (a save after it and a step to resume)",
            self.resume_after,
        )
        rws = self.resume_world_size
        check(rws is None or (is_int(rws) and rws >= 1), "resume_world_size", "null or a positive integer", rws)
        check(
            self.resume_engine is None or (isinstance(self.resume_engine, str) and bool(self.resume_engine)),
            "resume_engine",
            "null, 'fsdp2', 'fsdp1', 'pkg.module:NAME' or 'file.py:NAME'",
            self.resume_engine,
        )
        rtp = self.resume_tp
        check(rtp is None or (is_int(rtp) and rtp >= 1), "resume_tp", "null or a positive integer (1: no tp)", rtp)
        if rtp is not None and rtp != self.tp:
            # Pipeline stages beside tp are refused by the case (verify/dims/together.py); a user's step
            # is not modelled beside tp on either side of the resume.
            check(self.step is None, "resume_tp", "null with a user's step (not modelled beside tp)", rtp)
            world = rws if rws is not None else self.world_size
            if self.resume_mesh_shape is None or rws is not None:
                check(
                    world % rtp == 0,
                    "resume_tp",
                    f"a divisor of the resumed world size {world} (every rank: data-parallel ranks times tp)",
                    rtp,
                )
        for name in ("resume_ep", "resume_pp"):
            value = getattr(self, name)
            check(value is None or (is_int(value) and value >= 1), name, "null or a positive integer", value)
        from fsdp_verify.engines.compositions import check_resumed_degrees

        check_resumed_degrees(self)
        try:
            self.after_resume()
        except CaseError as e:
            raise for_the_resumed_run(e, self) from None

    def before_resume(self) -> Case:
        """The run up to the save: the first `resume_after` steps, as the case says."""
        return replace(self, steps=self.resume_after, **_NO_RESUME)

    def after_resume(self) -> Case:
        """The run that resumes: the same case on the resumed world size, mesh, engine and tp
        degree (it trains steps resume_after + 1 to steps; the loop learns where it is from the
        checkpoint). A new tp degree keeps the world size unless `resume_world_size` says otherwise
        (the data-parallel ranks change), and the data-parallel mesh unless it still fits; resumed
        at tp 1 the run has no plan, so none of the plan's styles (sequence and loss parallelism,
        a plan of the user's) either."""
        tp = self.resume_tp if self.resume_tp is not None else self.tp
        world = self.resume_world_size if self.resume_world_size is not None else self.world_size
        if self.resume_mesh_shape is not None:
            mesh = tuple(self.resume_mesh_shape)
            if self.resume_world_size is None:
                world = _product(mesh) * tp
        else:
            mesh = None if self.resume_world_size is not None or tp != self.tp else self.mesh_shape
        styles = {"tp_plan": None, "sequence_parallel": False, "loss_parallel": False} if tp == 1 else {}
        return replace(
            self,
            world_size=world,
            mesh_shape=mesh,
            engine=self.resume_engine or self.engine,
            tp=tp,
            **styles,
            ep=self.resume_ep if self.resume_ep is not None else self.ep,
            **self._resumed_pipeline(),
            **_NO_RESUME,
        )

    def _resumed_pipeline(self) -> dict[str, Any]:
        """The resumed run's pipeline: `resume_pp` stages with the case's schedule and split, or
        none (then no schedule nor split: a case without stages has none)."""
        pp = self.resume_pp if self.resume_pp is not None else self.pp
        if pp == 1:
            return {"pp": 1, "pp_schedule": "1f1b", "pp_split": None, "pp_scale_grads": True}
        return {"pp": pp}

    def _validate_custom(self) -> None:
        if self.step is not None:
            from fsdp_verify.imports import load_object

            check(
                _takes_four(load_object(self.step, "step")),
                "step",
                "a callable NAME(model, optimizer, batch, ctx)",
                self.step,
            )
        if self.data.padded:
            check(self.model.kind != "mlp", "data.padded", "false for an MLP (padding needs token sequences)", True)
        if not self.model.is_custom:
            return
        from fsdp_verify.models import custom

        info = custom.info(self.model)  # builds it on meta: a factory that fails is reported here
        if self.data.fn is None or self.loss is None:
            check(
                info.vocab_size is not None,
                "model.factory",
                "a model with an nn.Embedding (token ids are generated for it), or data.fn and loss",
                self.model.factory,
            )
        check(
            self.init == "eager" or self.model.init_fn is not None,
            "init",
            "'eager' for a model factory without an init_fn (a meta build has no values to replay)",
            self.init,
        )

    def _validate_wrap(self) -> None:
        classes = module_classes(self.model)
        if self.wrap is not None:
            for entry in self.wrap:
                if units.is_group(entry):  # one unit over several modules: each a module name
                    for member in units.members(entry):
                        check(
                            member in classes and member != "",
                            "wrap",
                            f"a group's members ({entry!r}) to be module names of the model other than the root"
                            f" (e.g. {sorted(n for n in classes if n)[:6]})",
                            member,
                        )
                    continue
                check(
                    entry in classes or entry in classes.values(),
                    "wrap",
                    f"module names or class names of the model (e.g. {sorted(classes)[:6]},"
                    f" {sorted(set(classes.values()))[:4]}), or modules joined by '+' for one unit over them",
                    entry,
                )
        plan = self.wrap_plan
        modules = [m for unit in plan for m in units.members(unit)]
        check(len(set(modules)) == len(modules), "wrap", "each module at most once", plan)
        order = {name: i for i, name in enumerate(classes)}  # the model's module order
        for unit in plan:
            inner = [(a, b) for a in units.members(unit) for b in units.members(unit) if units.is_ancestor(a, b)]
            check(not inner, "wrap", f"a group of modules none inside another ({unit!r})", plan)
            # FSDP2 lays a group's parameters out, and runs its post-forward, in the order given;
            # the model's order keeps both where the toolkit models them
            positions = [order.get(m, -1) for m in units.members(unit)]
            check(positions == sorted(positions), "wrap", f"a group's modules in the model's order ({unit!r})", plan)
        check(
            not any(m.startswith("moe.experts") for m in modules) or self.model.grouped_experts is not None,
            "wrap",
            "no routed expert as a unit of its own (a rank that routes no sample to it would skip its"
            " all-gather while the others run it)",
            plan,
        )
        check(bool(plan) and plan[-1] == "", "wrap", 'a plan that ends with the root ""', plan)
        if any(units.is_group(u) for u in plan):
            # a group's one unit over several modules: tried with tp and pp (each group in one
            # stage: verify/engines/pipeline_parallel.py), not with ep
            check(self.ep == 1, "wrap", "units of one module each beside ep (not modelled)", plan)
            # explicit prefetching's replay places a unit's pre-forward by module nesting, which
            # a group's first member does not follow (verify/checks/prefetch.py)
            check(self.prefetch is None, "wrap", "units of one module each beside prefetch (not modelled)", plan)
        for i, unit in enumerate(plan):
            for later in plan[i + 1 :]:
                check(
                    not any(units.is_ancestor(a, b) for a in units.members(unit) for b in units.members(later)),
                    "wrap",
                    f"children before parents ({later!r} is inside {unit!r})",
                    plan,
                )
        if self.model.kind == "transformer" and self.model.tie_embeddings and self.pp == 1:  # pp: two stages hold it
            a, b = units.owner_of_module(plan, "tok_embeddings"), units.owner_of_module(plan, "output")
            check(a == b, "wrap", "tok_embeddings and output in one shard unit when embeddings are tied", plan)
        if self.model.is_custom:
            from fsdp_verify.models.custom import tied_groups

            for names in tied_groups(self.model):
                owners = {units.owner_of_module(plan, n.rsplit(".", 1)[0] if "." in n else "") for n in names}
                check(len(owners) == 1, "wrap", f"the tied parameters {list(names)} in one shard unit", plan)

    def _validate_zoom(self) -> None:
        if self.zoom is None:
            return
        step, _, rest = str(self.zoom).partition("/")
        direction, _, _fqn = rest.partition("/")
        check(
            isinstance(self.zoom, str) and step.isdigit() and direction in ("", "forward", "backward"),
            "zoom",
            'null, "STEP", "STEP/forward/FQN" or "STEP/backward/FQN"',
            self.zoom,
        )

    def _validate_checkpointing(self) -> None:
        """A checkpointed unit's forward runs again in backward. The KV cache of a transformers
        model is turned off for it (verify/training/checkpointing.py), but running statistics
        have no such switch: BatchNorm's would be updated twice on the ranks and once on the
        reference, which never recomputes (a divergence of the buffers that no engine caused)."""
        if not (self.activation_checkpointing and self.model.is_custom):
            return
        from fsdp_verify.models.custom import running_stats

        for unit in self.wrap_plan[:-1]:
            inside = [m for m in running_stats(self.model) if m == unit or m.startswith(unit + ".")]
            check(
                not inside,
                "activation_checkpointing",
                f"false, or a wrap plan whose units hold no module that updates running statistics in forward"
                f" (unit {unit!r} holds {inside[:1]}: its recomputation in backward would update them a second"
                " time)",
                True,
            )

    def _validate_compile(self) -> None:
        """torch.compile's options (docs/compile.md), and what the compiled runs cannot take."""
        check(
            self.compile is None or self.compile in COMPILE_SCOPES,
            "compile",
            f"null or one of {COMPILE_SCOPES}",
            self.compile,
        )
        check(isinstance(self.compile_fullgraph, bool), "compile_fullgraph", "true or false", self.compile_fullgraph)
        check(
            self.compile_backend in COMPILE_BACKENDS,
            "compile_backend",
            f"one of {COMPILE_BACKENDS}",
            self.compile_backend,
        )
        if self.compile is None:
            check(not self.compile_fullgraph, "compile_fullgraph", "false without compile", True)
            check(
                self.compile_backend == "inductor",
                "compile_backend",
                "'inductor' without compile",
                self.compile_backend,
            )
            return
        breaks = fullgraph_breaks(self) if self.compile_fullgraph else None
        check(breaks is None, "compile_fullgraph", f"false where {breaks}", True)
        check(
            self.compile != "units" or len(self.wrap_plan) > 1,
            "compile",
            "'model' or null for a wrap plan of the root alone ('units' compiles each unit but the root)",
            self.compile,
        )
        check(
            self.compile != "blocks" or any(units.is_block(u) for u in self.wrap_plan),
            "compile",
            "'units', 'model' or null for a wrap plan without a block ('blocks' compiles each unit that is an"
            " element of a module list or dict, such as layers.0)",
            self.compile,
        )
        check_together(self, "compile")

    def _validate_modelled_together(self) -> None:
        """Refuse, naming the field, a setting not modelled beside tp (verify/dims/together.py,
        the one table; ep, pp and compile are checked there too, after their own fields)."""
        check_together(self, "tp")

    def _validate_dims(self) -> None:
        """Each registered package's spec: its own fields, what it asks of the case, and the
        together table's rows beside it (verify/dims/registry.py)."""
        check(isinstance(self.dims, DimSpecs), registry.FIELD, "dimension specs (verify/dims/registry.py)", self.dims)
        self.dims.validate()
        for package, spec in registry.on(self):
            if package.validate is not None:
                package.validate(self, spec)
            check_together(self, package.name)

    def _validate_tp(self) -> None:
        """Tensor parallelism's fields (docs/tensor-parallel.md): a degree, a plan that splits the
        model evenly over it, and the knobs modelled beside it."""
        for name in ("sequence_parallel", "loss_parallel"):
            check(isinstance(getattr(self, name), bool), name, "true or false", getattr(self, name))
        check(self.tp_plan is None or is_import_path(self.tp_plan), "tp_plan", f"null or {IMPORT_PATH}", self.tp_plan)
        if self.tp == 1:
            for name in ("tp_plan", "sequence_parallel", "loss_parallel"):
                value = getattr(self, name)
                check(value in (None, False), name, f"{'null' if name == 'tp_plan' else 'false'} with tp=1", value)
            return
        rsf = self.reshard_after_forward
        check(
            isinstance(rsf, bool) or not 1 < rsf < self.mesh[-1],
            "reshard_after_forward",
            f"true or false with tp={self.tp}, or an int that is not below the shard group {self.mesh[-1]}: FSDP2"
            " (torch 2.13) builds the post-forward mesh of a data-parallel sub-mesh on some ranks only, a hang"
            " (tests/upstream/test_fsdp2_int_reshard_on_a_submesh.py)",
            rsf,
        )
        if self.sequence_parallel:
            check(
                self.model.kind == "transformer" and self.tp_plan is None,
                "sequence_parallel",
                "false unless the built-in Transformer's plan is used (a plan of your own decides its own styles)",
                True,
            )
        if self.loss_parallel:
            check(
                self.model.kind != "mlp" and self.loss in (None, *VOCABULARY_PARALLEL_LOSSES),
                "loss_parallel",
                "false for an MLP or a loss of your own (loss parallelism computes the cross-entropy; of the"
                f" losses named, only {', '.join(VOCABULARY_PARALLEL_LOSSES)} takes it)",
                True,
            )
        from fsdp_verify.engines.tensor_parallel import check_plan

        check_plan(self)

    # ---- derived ------------------------------------------------------------------------------
    @property
    def mesh(self) -> tuple[int, ...]:
        """The data-parallel mesh: (shard,) or (replicate, shard), of `dp_size` ranks."""
        return tuple(self.mesh_shape) if self.mesh_shape is not None else (self.dp_size,)

    @property
    def parallel(self) -> ParallelDims:
        """The one owner of the degrees, the data-parallel size, each rank's coordinates and the
        mesh (verify/dims/parallel_dims.py): everything that needs them asks it."""
        return ParallelDims.of(self)

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: every rank, or under pipeline parallelism each stage's ranks (the
        stages of one data-parallel rank take one batch), under tensor parallelism every tp group."""
        pp, tp = (d if is_int(d) and d >= 1 else 1 for d in (self.pp, self.tp))
        return self.world_size // (pp * tp)

    @property
    def _parallel_degrees(self) -> str:
        """The degrees that divide the world into data-parallel ranks, as a message says them
        ("tp=2", "pp=2"), "" without."""
        return " x ".join(f"{n}={d}" for n, d in self.parallel.dividing)

    @property
    def device_mesh_shape(self) -> tuple[int, ...]:
        """Every rank's mesh (`parallel.shape`): the stages, the data-parallel mesh, tp."""
        return self.parallel.shape

    @property
    def wrap_plan(self) -> tuple[str, ...]:
        """Units, children first, the root last: module FQNs, or several joined by '+' for one
        unit over them (verify/units.py). A class name in `wrap` stands for every module of that
        class (as torchtitan and accelerate's FSDP2 plans wrap each decoder layer); a plan that
        names a class is ordered deepest first, so children still come first."""
        if self.wrap is None:
            return default_wrap_plan(self.model)
        classes = module_classes(self.model)
        if all(units.is_group(entry) or entry in classes for entry in self.wrap):
            return tuple(self.wrap)
        expanded: list[str] = []
        for entry in self.wrap:
            matches = (
                [entry] if units.is_group(entry) or entry in classes else [n for n, c in classes.items() if c == entry]
            )
            expanded += [m for m in matches if m not in expanded]
        inner = sorted((n for n in expanded if n), key=lambda n: -max(m.count(".") for m in units.members(n)))
        return tuple(inner) + (("",) if "" in expanded else ())

    @property
    def local_batch(self) -> int:
        """Samples of one data-parallel rank (the stages of a pipeline, the ranks of a tp group share them)."""
        return self.data.batch_size // self.dp_size

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, except the optional fields of user models, data and losses while they are
        at their defaults: a built-in case keeps the JSON and the hash it had before they existed
        (an older revision can still replay it under `git bisect`)."""
        data = _plain(self)
        nested = ((data, self), (data["model"], self.model), (data["data"], self.data), (data["optim"], self.optim))
        for where, spec in nested:
            defaults = {f.name: f for f in fields(spec)}
            for name in type(spec).OPTIONAL_FIELDS:
                f = defaults[name]
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                if where[name] == default or (isinstance(default, tuple) and tuple(where[name]) == default):
                    del where[name]
        if not data[registry.FIELD]:  # no package on: the JSON and hash of a case from before them
            del data[registry.FIELD]
        if self.model.is_custom:  # the built-in models' sizes mean nothing to a factory
            for name in ModelSpec.BUILTIN_FIELDS:
                if getattr(self.model, name) == getattr(ModelSpec(), name):
                    del data["model"][name]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        return _build(cls, data, "")

    @classmethod
    def from_json(cls, text: str) -> Case:
        """A Case from JSON in hand (the caller's own): its code is imported as it validates."""
        return cls.from_dict(_parse(text))

    @classmethod
    def load(cls, path: str | Path, trust_code: bool = False, allowed: Iterable[str] = ()) -> Case:
        """A Case from a file, which is data: code it names that is not the toolkit's, not in
        `allowed` (what the command line typed) nor trusted (`trust_code`, FSDP_VERIFY_TRUST_CODE,
        pyproject.toml) is refused before anything is imported (verify/trust.py)."""
        from fsdp_verify.trust import refuse_untrusted

        data = _parse(Path(path).read_text())
        refuse_untrusted(data, path, trust_code=trust_code, allowed=allowed)
        return cls.from_dict(data)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path

    @property
    def hash(self) -> str:
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    def with_(self, **changes: Any) -> Case:
        """`replace` that also accepts dotted keys for nested specs: with_(**{"optim.lr": 0.1})."""
        nested: dict[str, dict[str, Any]] = {}
        flat: dict[str, Any] = {}
        for key, value in changes.items():
            if "." in key:
                head, tail = key.split(".", 1)
                nested.setdefault(head, {})[tail] = value
            else:
                flat[key] = value
        for head, sub in nested.items():
            current = flat.get(head, getattr(self, head))
            flat[head] = current.with_(**sub) if isinstance(current, DimSpecs) else replace(current, **sub)
        return replace(self, **flat)


# The fields of the run that resumes, as the case spells them (`for_the_resumed_run`); ep and pp
# only where the case sets them (otherwise the resumed run's degree is the case's own, and what it
# refuses follows from the resumed world size or mesh).
_RESUMED_FIELDS = {
    "world_size": "resume_world_size",
    "mesh_shape": "resume_mesh_shape",
    "tp": "resume_tp",
    "engine": "resume_engine",
}


def for_the_resumed_run(e: CaseError, case: Case) -> CaseError:
    """`e`, raised by the resumed run's case (`Case.after_resume`), naming the case's field that
    set what it refused (`resume_tp` for its `tp`, `resume_ep` for its `ep` where set, ...)."""
    fields = dict(_RESUMED_FIELDS)
    fields.update({name: f"resume_{name}" for name in ("ep", "pp") if getattr(case, f"resume_{name}") is not None})
    return CaseError(fields.get(e.field_path, e.field_path), f"{e.expected} (for the resumed run)", e.got)


_NO_RESUME = {"resume_after": None, **dict.fromkeys(RESUMED_ON)}

_SPECS = {"optim": OptimSpec, "precision": PrecisionSpec, "data": DataSpec, "loss_scaling": LossScaleSpec}


def check_field_value(name: str, value: Any) -> None:
    """Raise the CaseError a value of field `name` (dotted for nested specs) gets whatever else
    the case holds (`optim.name="lamb"`, `steps=0`): a draw pinned to it is refused before any
    draw, naming the field, rather than discarded draw after draw. A value that is only wrong
    beside other fields (a batch size some world sizes do not divide) passes."""
    if name.startswith(("model", "wrap")):
        return
    if name == "ignored" and isinstance(value, tuple) and all(isinstance(n, str) and n for n in value):
        return  # names, judged against the drawn model (the drawn Case refuses one that names none)
    if name in (
        "pp",
        "pp_schedule",
        "pp_split",
        "pp_scale_grads",
    ):  # wrong only beside the world, model, micro-batches drawn
        from fsdp_verify.engines.pipeline_parallel import check_pipeline_value

        check_pipeline_value(name, value)
        return
    if name == "ep":  # wrong beside a model without grouped experts or a mesh it does not divide
        check(is_int(value) and value >= 1, "ep", "a positive integer (1: no expert parallelism)", value)
        return
    if name in ("resume_ep", "resume_pp"):  # wrong only beside no resume or a resumed mesh it does not fit
        check(value is None or (is_int(value) and value >= 1), name, "null or a positive integer", value)
        return
    if name == "tp_plan":  # its module names judged against the drawn model (a user's model's plan)
        check(value is None or is_import_path(value), "tp_plan", f"null or {IMPORT_PATH}", value)
        return
    head, _, tail = name.partition(".")
    try:
        if head == registry.FIELD:  # a package's field: judged by its spec, on (a pin may leave other fields drawn)
            DimSpecs.check_value(tail, value)
        elif tail and head in _SPECS:
            _SPECS[head](**{tail: value}).validate()
        elif not tail:
            changes = {name: value}
            if name == "mesh_shape" and isinstance(value, tuple) and all(isinstance(d, int) for d in value):
                changes["world_size"] = _product(value)
            if name == "replica_sync_last":  # wrong only beside a 1-D mesh: judged on a 2-D one
                changes.update(mesh_shape=(1, 2), world_size=2)
            if name in ("compile_fullgraph", "compile_backend"):  # options of compile: judged with it
                changes.update(compile="model", wrap=("",))
            if name in ("sequence_parallel", "loss_parallel"):  # wrong only without tp
                changes.update(tp=2)
            Case().with_(**changes)
    except CaseError as e:
        if e.field_path == name:
            raise
    except TypeError:
        pass  # a value of the wrong kind altogether: the Case it is drawn into names it


def fullgraph_breaks(case: Case) -> str | None:
    """Why fullgraph=True cannot hold for `case`, or None: what `compile_fullgraph` needs. A unit
    inside a compiled module (FSDP2 runs its hooks outside any graph: a graph break), or, under
    `units`, a unit that is a torch.nn module (its forward is in a file Dynamo skips, so there is
    no frame to compile, which fullgraph=True raises on: pytorch/pytorch#150915; judged by class
    name, as the model is known by its classes before it is built)."""
    if case.compile == "model":
        compiled = [""]
    else:
        compiled = [u for u in case.wrap_plan if u and (case.compile != "blocks" or units.is_block(u))]
    classes = module_classes(case.model)
    for outer in compiled:
        inner = next((u for u in case.wrap_plan if units.inside(u, outer)), None)
        if inner is not None:
            return (
                f"a unit's FSDP2 hooks run inside a compiled module (unit {inner!r} inside the compiled"
                f" {repr(outer) if outer else 'model'}): FSDP2 runs them outside any graph (a graph break),"
                " which fullgraph=True refuses"
            )
        if outer and _is_torch_nn(classes.get(outer)):
            return (
                f"a compiled unit is a torch.nn module ({outer!r}, {classes[outer]}): Dynamo skips its forward,"
                " so fullgraph=True finds no frame to compile (pytorch/pytorch#150915)"
            )
    return None


def _is_torch_nn(class_name: str | None) -> bool:
    import torch

    return class_name is not None and isinstance(getattr(torch.nn, class_name, None), type)


def _product(values: tuple[int, ...]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CaseError("<file>", "valid JSON", str(e)) from None


_TUPLE_FIELDS = {"widths", "frozen", "ignored", "betas", "wrap", "mesh_shape", "shrinkable", "resume_mesh_shape"}


def loss_scaling_from_dict(data: Any) -> LossScaleSpec:
    """A LossScaleSpec from a JSON object (unknown keys named as `loss_scaling.KEY`); its
    values are validated with the Case that holds it."""
    return _build(LossScaleSpec, data, "loss_scaling")


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix or "<case>"
    if not isinstance(data, dict):
        raise CaseError(where, "a JSON object", data)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise CaseError(
            f"{prefix + '.' if prefix else ''}{unknown[0]}", f"one of the fields {sorted(known)}", unknown[0]
        )
    kwargs: dict[str, Any] = {}
    sub_specs = {
        "model": ModelSpec,
        "precision": PrecisionSpec,
        "optim": OptimSpec,
        "data": DataSpec,
        "loss_scaling": LossScaleSpec,
    }
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        if cls is Case and name == "loss_scaling" and value is None:
            pass
        elif cls is Case and name == registry.FIELD:
            value = DimSpecs.from_dict(value, _build)
        elif cls is Case and name in sub_specs:
            value = _build(sub_specs[name], value, path)
        elif (name in _TUPLE_FIELDS or isinstance(known[name].default, tuple)) and value is not None:
            if not isinstance(value, (list, tuple)):
                raise CaseError(path, "a list", value)
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # wrong types that slipped through validation
        raise CaseError(where, "fields of the right type", str(e)) from None


def _takes_four(fn: Any) -> bool:
    """Whether a user's step can be called as NAME(model, optimizer, batch, ctx): checked here, so
    a wrong signature is bad input named `step`, not a TypeError inside every rank."""
    import inspect

    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(None, None, None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the call decide
        return True
    return True


def _plain(value: Any) -> Any:
    """`dataclasses.asdict` for a Case's values (specs, scalars, tuples, lists, JSON objects),
    at a fifth of its cost: asdict deep-copies every leaf, and a check turns its Case into JSON
    and its hash three or four times."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, DimSpecs):
        return {name: _plain(spec) for name, spec in value.turned_on()}
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
