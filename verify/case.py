"""Case: the one frozen, JSON-round-trippable description of a run.

Everything a run does follows from its Case (model, wrap plan, world size, precision, optimizer,
steps, data, seeds, engine); nothing from globals. Its content hash names caches and repro files.
Validation happens on construction and names the offending field and what was expected, so a bad
`--case FILE` fails with exit code 2 before any process is started.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from fsdp_verify import case_rules, units
from fsdp_verify.case_specs import (
    RESUMED_ON,
    DataSpec,
    LossScaleSpec,
    OptimSpec,
    PrecisionSpec,
)
from fsdp_verify.dims import registry
from fsdp_verify.dims.parallel_dims import ParallelDims
from fsdp_verify.dims.registry import DimSpecs
from fsdp_verify.models import ModelSpec, default_wrap_plan, module_classes
from fsdp_verify.models.spec import IMPORT_PATH, is_import_path
from fsdp_verify.validation import CaseError, check, is_int


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

    def validate(self) -> None:
        """Every rule of verify/case_rules.py: a CaseError naming the field and what was expected."""
        case_rules.validate(self)

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
