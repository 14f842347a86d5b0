"""Capabilities: which cases an engine can take, as it declares them, the way it declares its
arithmetic and contracts (verify/engines/arithmetic.py, contracts.py).

An engine is held only to what it declares. One that declares nothing takes the stable contract
(`ShardSpec`: the wrap plan, mixed precision, `reshard_after_forward`, a 1-D or 2-D mesh) and
what the toolkit's loop does to any FSDP2 module (micro-batches and no-sync, `replica_sync_last`,
`reshard_after_backward_last`, unfreezing, optimizers, schedules, clipping, checkpointing,
resume). Every knob the *engine* must apply itself (`offload`, `shard_placement`, `ignored`,
`grad_reduction`, `prefetch`, routed experts, `compile`) is opt-in: drawn, and taken by `check`, only for an
engine that lists it in `takes`:

    shard.capabilities = Capabilities(takes=("offload", "prefetch"))

A case asking for what the engine does not take is bad input, not a rank failure: the parent
process refuses it before any rank starts (exit 2, naming the field and how to declare it), and
the case strategies draw only what the engine takes. The built-in engines declare theirs here
like any other (`fsdp2` takes every knob; `fsdp1` and `flat` shard FlatParameters and take none
of fully_shard's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdp_verify import units
from fsdp_verify.dims import registry
from fsdp_verify.validation import CaseError

MESH_FORMS = {1: "(shard,)", 2: "(replicate, shard)"}


@dataclass(frozen=True)
class Knob:
    """One optional setting of a case: its name as declared, the Case field it lives in, its
    value when not asked for, and what applying it means (for the messages)."""

    name: str
    field: str  # the Case field, dotted for nested ones ("model.experts")
    off: Any
    applies: str
    # Where asking is not the field differing from `off` (a unit over several modules is asked
    # by one entry of the wrap plan): how to tell, and what a refusal says was expected.
    asks: Callable[[Any], bool] | None = None
    expected: str | None = None

    def value(self, case) -> Any:
        head, _, rest = self.field.partition(".")
        value = getattr(case, head)
        return getattr(value, rest) if rest else value

    def asked(self, case) -> bool:
        return self.asks(case) if self.asks is not None else self.value(case) != self.off


def _has_groups(case) -> bool:
    return any(units.is_group(u) for u in case.wrap_plan)


# What the engine applies itself, through fully_shard's arguments or the FSDP2 module's setters
# after sharding (`ShardSpec.fully_shard_kwargs` and `ShardSpec.after_sharding` do all of it).
ENGINE_KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("offload", "offload", False, "fully_shard(offload_policy=CPUOffloadPolicy())"),
        Knob("shard_placement", "shard_placement", "dim0", "fully_shard(shard_placement_fn=...)"),
        Knob("ignored", "ignored", (), "fully_shard(ignored_params=...)"),
        Knob("grad_reduction", "grad_reduction", "avg", "set_gradient_divide_factor(1.0) on every unit"),
        Knob("prefetch", "prefetch", None, "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch"),
        Knob("experts", "model.experts", 0, "set_reduce_scatter_unused_params(True) (routed experts)"),
        # torch.compile, applied by the engine where torchtitan applies it (after activation
        # checkpointing, before fully_shard), its options `compile_fullgraph` and `compile_backend`
        # with it: docs/compile.md.
        Knob("compile", "compile", None, "ShardSpec.compile(model) before fully_shard: module.compile(...) in place"),
        # One unit over several modules ("norm+output" in the plan): fully_shard([a, b]), as
        # torchtitan shards [norm, lm_head] (verify/units.py).
        Knob(
            "groups",
            "wrap",
            None,
            "fully_shard(spec.unit_modules(model, fqn)): a list of modules for a unit over several",
            asks=_has_groups,
            expected="units of one module each",
        ),
    )
}
# Parallelisms composed with FSDP: the engine applies them before `fully_shard` (`ShardSpec.
# parallelize`, `expert_parallel`, `pipeline`). Not among ENGINE_KNOBS: a plug-in that passes
# `fully_shard_kwargs` through takes every FSDP2 knob, yet applies no plan, shards no experts over
# an ep mesh and cuts no stages unless it says so.
PARALLEL_KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob(
            "ep",
            "ep",
            1,
            "the grouped experts over mesh['ep'] with all-to-all dispatch, then fully_shard: ShardSpec.expert_parallel",
        ),
        Knob("pp", "pp", 1, "the model cut into stages over mesh['pp'], each stage sharded: ShardSpec.pipeline"),
        Knob("tp", "tp", 1, "parallelize_module(model, mesh['tp'], plan) before fully_shard: ShardSpec.parallelize"),
        Knob("sequence_parallel", "sequence_parallel", False, "the plan's SequenceParallel norms"),
        Knob("loss_parallel", "loss_parallel", False, "the plan's head sharded over the vocabulary"),
    )
}
# The registered dimension packages (verify/dims/registry.py): each applied by the engine
# (`ShardSpec.convert`), opt-in as the parallelisms are.
DIMENSION_KNOBS: dict[str, Knob] = {
    p.name: Knob(p.name, f"{registry.FIELD}.{p.name}", p.off, p.applies) for p in registry.packages()
}
# What the toolkit's loop applies to the engine's module (FSDPModule's setters, requires_grad_):
# taken by an engine that declares nothing, since any FSDP2 module has them; FSDP1 and the flat
# engine do not (their modules lack the setters, or fix what trains when they shard).
LOOP_KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("replica_sync_last", "replica_sync_last", False, "FSDPModule.set_requires_all_reduce"),
        Knob(
            "reshard_after_backward_last", "reshard_after_backward_last", False, "FSDPModule.set_reshard_after_backward"
        ),
        Knob("unfreeze_step", "unfreeze_step", None, "requires_grad_(True) on the frozen parameters mid-run"),
    )
}
KNOBS: dict[str, Knob] = {**ENGINE_KNOBS, **PARALLEL_KNOBS, **DIMENSION_KNOBS, **LOOP_KNOBS}
# What `takes` may name: what the engine applies itself.
TAKEABLE: dict[str, Knob] = {**ENGINE_KNOBS, **PARALLEL_KNOBS, **DIMENSION_KNOBS}


def _names(given, allowed: dict[str, Knob], what: str) -> frozenset[str]:
    names = frozenset((given,) if isinstance(given, str) else given)
    unknown = sorted(names - set(allowed))
    if unknown:
        raise ValueError(f"capabilities: {what} must name some of {tuple(allowed)}, got {unknown[0]!r}")
    return names


@dataclass(frozen=True)
class Capabilities:
    # The mesh ranks the engine shards on: 1 = a 1-D mesh (shard,); 2 = (replicate, shard), every
    # shape (HSDP, and the degenerate (1, W), (W, 1) and (1, 1)).
    mesh_dims: tuple[int, ...] = (1, 2)
    # The engine-side knobs and parallelisms it applies (names from ENGINE_KNOBS and
    # PARALLEL_KNOBS): none unless declared.
    takes: frozenset[str] = field(default_factory=frozenset)
    # The loop-side settings its module takes (names from LOOP_KNOBS): all of them, as any FSDP2
    # module does, unless declared otherwise.
    module_takes: frozenset[str] = field(default_factory=lambda: frozenset(LOOP_KNOBS))
    # Whether it applies `precision.output_dtype` (FSDP1 has none).
    output_dtype: bool = True
    # Whether an int `reshard_after_forward` must divide the shard dimension (FSDP2's
    # `_get_post_forward_mesh_info` raises otherwise; FSDP1 and the flat engine take an int as True).
    reshard_int_divides_shard: bool = True
    # Whether it decides each unit's `reshard_after_forward` itself (a framework's policy:
    # torchtitan's blocks reshard, its `[norm, lm_head]` and root do not). The contracts take each
    # unit's as the engine built it either way; an engine that does not declare this is held to
    # the case's value on every unit (the knobs check names a unit built otherwise).
    reshard_per_unit: bool = False
    # Whether it takes an int `reshard_after_forward` at all (Accelerate's FSDP2 plugin takes a
    # bool only: verify/frameworks/accelerate.py).
    reshard_ints: bool = True
    # Whether it applies activation checkpointing itself where the case asks for it (a
    # framework's own policy: torchtitan's selective or full AC, `checkpoint_wrapper` on each
    # block before `fully_shard`); the loop then checkpoints nothing. Otherwise the loop
    # checkpoints each unit of the plan before the engine runs (verify/training/checkpointing.py).
    # The wrappers' `_checkpoint_wrapped_module.` segments are read through either way
    # (verify/module_names.py).
    checkpoints: bool = False
    # Where it takes `compile`: the scopes it compiles (verify/case_specs.py COMPILE_SCOPES; None: every
    # one, as `ShardSpec.compile` does), whether it compiles with fullgraph=True always (True),
    # never (False) or as the case asks (None), and the Dynamo options it sets process-wide for its
    # compile, which the reference sets alike so that both trace the same graphs (torchtitan's
    # `apply_compile`: each block of `model.layers`, fullgraph, `capture_scalar_outputs` and
    # `skip_fwd_side_effects_in_bwd_under_checkpoint` on). A rank's options are put back before
    # every compiled case (verify/training/compile.py `fresh_compiler`).
    compile_scopes: tuple[str, ...] | None = None
    compile_fullgraph: bool | None = None
    dynamo_config: tuple[tuple[str, Any], ...] = ()
    # torch.compile's `dynamic` as it compiles: False (`ShardSpec.compile`: each graph a function of
    # its shapes) or None (torch's automatic dynamic shapes: torchtitan's `module.compile(backend,
    # fullgraph=True)`), which the reference then compiles with too. `ShardSpec.compile` compiles
    # with False: an engine that compiles through it leaves this False.
    compile_dynamic: bool | None = False
    # Under pp, where the engine builds its own schedule (torchtitan's `pipeline_llm`): its
    # `scale_grads` (None: the case's, as the toolkit's `ShardSpec.pipeline` builds it).
    pp_scale_grads: bool | None = None
    # The engine's own refusals: `fn(case)` raising CaseError (naming the field) for a case it
    # cannot build as the reference models it, checked with the rest before any rank starts
    # (torchtitan's experts on dim 1: verify/frameworks/torchtitan.py).
    refuses: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        if not self.mesh_dims or any(d not in MESH_FORMS for d in self.mesh_dims):
            raise ValueError(f"capabilities: mesh_dims must be a non-empty subset of (1, 2), got {self.mesh_dims!r}")
        object.__setattr__(self, "takes", _names(self.takes, TAKEABLE, "takes"))
        object.__setattr__(self, "module_takes", _names(self.module_takes, LOOP_KNOBS, "module_takes"))

    def taken(self) -> frozenset[str]:
        """Every optional knob this engine takes, engine-side and loop-side."""
        return self.takes | self.module_takes

    def accepts(self) -> str:
        return " or ".join(f"a {d}-D mesh {MESH_FORMS[d]}" for d in sorted(self.mesh_dims))

    def refuse(self, case, engine: str) -> None:
        """Raise CaseError naming the field when `case` asks for what the engine cannot take."""
        if len(case.mesh) not in self.mesh_dims:
            raise CaseError("mesh_shape", f"{self.accepts()}: what engine {engine!r} takes", case.mesh_shape)
        if not self.output_dtype and case.precision.output_dtype is not None:
            raise CaseError(
                "precision.output_dtype", f"null: engine {engine!r} has no output_dtype", case.precision.output_dtype
            )
        for knob in KNOBS.values():
            if knob.asked(case) and knob.name not in self.taken():
                expected = knob.expected or repr(knob.off)
                raise CaseError(knob.field, f"{expected}: {not_declared(engine, knob.name)}", knob.value(case))
        refused = self.compile_refusal(engine, case.compile, case.compile_fullgraph)
        if refused is not None:
            raise CaseError(*refused)
        if case.pp > 1 and self.pp_scale_grads is not None and case.pp_scale_grads != self.pp_scale_grads:
            expected = f"{str(self.pp_scale_grads).lower()}: how engine {engine!r} builds its schedule"
            raise CaseError("pp_scale_grads", expected, case.pp_scale_grads)
        rsf, shard = case.reshard_after_forward, case.mesh[-1]
        if not self.reshard_ints and not isinstance(rsf, bool):
            raise CaseError("reshard_after_forward", f"true or false: what engine {engine!r} takes", rsf)
        if self.reshard_int_divides_shard and not isinstance(rsf, bool) and shard % rsf:
            raise CaseError(
                "reshard_after_forward",
                f"true, false or an int dividing the shard dimension {shard} (mesh {case.mesh}): what engine"
                f" {engine!r} takes",
                rsf,
            )
        if self.refuses is not None:
            self.refuses(case)

    def compile_refusal(self, engine: str, scope: Any, fullgraph: Any) -> tuple[str, str, Any] | None:
        """(field, expected, got) where a compile `scope` (None: not compiled) or its `fullgraph`
        is not how the engine compiles; None where it is. One rule for a case (`refuse`) and for
        the draws' pins (properties/strategies.py), which may hold strategies: only values count."""
        if scope is None:
            return None
        if self.compile_scopes is not None and isinstance(scope, str) and scope not in self.compile_scopes:
            return "compile", f"one of {self.compile_scopes}: what engine {engine!r} compiles", scope
        wanted = self.compile_fullgraph
        if wanted is not None and isinstance(fullgraph, bool) and fullgraph != wanted:
            return "compile_fullgraph", f"{str(wanted).lower()}: how engine {engine!r} compiles", fullgraph
        return None


def not_declared(engine: str, knob: str) -> str:
    """Why a knob is refused for `engine`, and how an engine declares it."""
    if knob in LOOP_KNOBS:
        return f"engine {engine!r} declares its module does not take `{knob}` ({LOOP_KNOBS[knob].applies})"
    return (
        f"engine {engine!r} does not declare `{knob}` ({TAKEABLE[knob].applies}); an engine that applies it"
        f" declares `capabilities = Capabilities(takes=({knob!r}, ...))` (docs/engines.md#what-an-engine-declares)"
    )


# An engine that declares nothing: the stable contract and the loop's settings.
PLAIN = Capabilities()
# `fully_shard` with every knob applied (the built-in engine, and a plug-in that passes
# `ShardSpec.fully_shard_kwargs` through and calls `ShardSpec.after_sharding`), after the case's
# parallelisms (`ShardSpec.parallelize`, `expert_parallel`, `pipeline`).
FSDP2 = Capabilities(takes=frozenset(TAKEABLE))


def capabilities_of(engine: object) -> Capabilities:
    declared = getattr(engine, "capabilities", None)
    return declared if isinstance(declared, Capabilities) else PLAIN
