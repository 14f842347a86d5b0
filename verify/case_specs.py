"""The parts of a Case that are specs of their own (precision, optimizer, data, fp16 loss
scaling) and the vocabularies its fields take: read by the Case, its rules (case_rules.py) and the
draws, none of which needs the Case for them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from fsdp_verify import dtypes
from fsdp_verify.models.spec import IMPORT_PATH, is_import_path
from fsdp_verify.validation import check, is_int, is_number

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
