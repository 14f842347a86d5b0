"""Float8 training as torchao applies it (`convert_to_float8_training`), composed with FSDP2: one
dimension package (verify/dims/registry.py), registered by one line in verify/dims/registered.py.

The case: `dims.float8` (`--float8 tensorwise|rowwise|rowwise_with_gw_hp`, torchao's recipes;
`--float8-all-gather`: FSDP2 all-gathers the weights in float8, torchao's
`enable_fsdp_float8_all_gather`, tensorwise only; `--float8-precompute`: the weights' scales
computed for the next all-gather by one all-reduce after each optimizer step,
`precompute_float8_dynamic_scale_for_fsdp`; `--float8-skip`: module names left in high
precision, torchtitan's `filter_fqns`). Which modules are converted is one rule (`converts`):
every `nn.Linear` whose in and out features are multiples of 16 (what `torch._scaled_mm`
takes), whose weight no other module shares (a tied head: the float8 weight wrapper would untie
it), and whose name no `skip` entry is part of.

The engine side (`runtime.convert`, called by `ShardSpec.convert` before anything else, where
torchtitan's model converters run), the reference (`runtime.convert_reference`: the same
conversion on one device, where each cast's amax is over the whole tensor), the loop's hook
(`runtime.after_optimizer_step`), the knobs check (`runtime.applied`) and the mutants
(`mutants.py`) are this package's; docs/float8.md says what is emulated and measured.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from fsdp_verify.commands.flag import Flag, boolean, names, or_none
from fsdp_verify.dims.registry import DimensionPackage
from fsdp_verify.dims.together import NotModelled
from fsdp_verify.validation import CaseError, check

NAME = "float8"
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values
MULTIPLE = 16  # torch._scaled_mm's: both dims of a converted weight


@dataclass(frozen=True)
class Float8Spec:
    """Off while `recipe` is None."""

    recipe: str | None = None
    all_gather: bool = False
    precompute: bool = False
    skip: tuple[str, ...] = ()

    def validate(self, prefix: str = "dims.float8") -> None:
        check(
            self.recipe is None or self.recipe in RECIPES, f"{prefix}.recipe", f"null or one of {RECIPES}", self.recipe
        )
        check(isinstance(self.all_gather, bool), f"{prefix}.all_gather", "true or false", self.all_gather)
        check(isinstance(self.precompute, bool), f"{prefix}.precompute", "true or false", self.precompute)
        check(
            isinstance(self.skip, tuple) and all(isinstance(s, str) and s for s in self.skip),
            f"{prefix}.skip",
            "a list of module names",
            self.skip,
        )
        if self.recipe is None:
            check(self == Float8Spec(), prefix, "no float8 option without a recipe (--float8 RECIPE)", self)
        check(
            not self.all_gather or self.recipe == "tensorwise",
            f"{prefix}.all_gather",
            "false: torchao all-gathers in float8 with tensorwise scaling only",
            self.all_gather,
        )
        check(
            not self.precompute or self.all_gather,
            f"{prefix}.precompute",
            "false: the scales are precomputed for the float8 all-gather (all_gather true)",
            self.precompute,
        )


def converts(fqn: str, in_features: int, out_features: int, shared: bool, spec: Float8Spec) -> bool:
    """Whether module `fqn` (an nn.Linear) is converted: the package's one rule."""
    return (
        in_features % MULTIPLE == 0
        and out_features % MULTIPLE == 0
        and not shared
        and not any(s in fqn for s in spec.skip)
    )


def builtin_linears(model) -> list[tuple[str, int, int, bool]] | None:
    """(name, in, out, shared) of a built-in model's linear layers, from its spec alone; None for
    a user's model (read when it is built: `runtime.applied`)."""
    if model.kind == "mlp":
        w = model.widths
        return [(f"layers.{i}.linear", w[i], w[i + 1], False) for i in range(len(w) - 1)]
    if model.kind == "transformer":
        d, h = model.dim, model.ffn_hidden
        out = []
        for i in range(model.n_layers):
            out += [(f"layers.{i}.attention.w{x}", d, d, False) for x in "qkvo"]
            out += [(f"layers.{i}.feed_forward.w1", d, h, False), (f"layers.{i}.feed_forward.w2", h, d, False)]
            out += [(f"layers.{i}.feed_forward.w3", d, h, False)]
        return out + [("output", d, model.vocab_size, model.tie_embeddings)]
    return None


def uneven_rows(model, shard: int, spec: Float8Spec) -> list[str]:
    """A built-in model's converted layers whose rows a shard group of `shard` does not divide:
    torchao 0.18 cannot all-gather them in float8 (pytorch/ao#3982)."""
    return [n for n, i, o, t in builtin_linears(model) or () if converts(n, i, o, t, spec) and o % shard]


def float8_only_units(case, spec: Float8Spec) -> list[str]:
    """The units of a built-in model's plan whose gathered parameters are all converted weights
    (an ignored parameter stays out of FSDP2's all-gather: sweep 9502's `ignored` bias beside
    its weight): FSDP2 all-gathers such a unit in float8 itself (not uint8 beside another dtype),
    which gloo cannot ("Invalid scalar type": no float8 in gloo's all-gather); NCCL can."""
    from fsdp_verify import units
    from fsdp_verify.models import is_ignored, parameter_names

    linears = builtin_linears(case.model)
    if linears is None or not spec.all_gather:
        return []
    weights = {f"{n}.weight" for n, i, o, t in linears if converts(n, i, o, t, spec)}
    held: dict[str, list[str]] = {}
    for name in parameter_names(case.model):
        if not is_ignored(tuple(case.ignored), name):
            held.setdefault(units.owner_of_param(case.wrap_plan, name), []).append(name)
    return [u for u, names in held.items() if all(n in weights for n in names)]


def _validate(case, spec: Float8Spec) -> None:
    """What float8 asks of the rest of the case: torchao installed, a linear layer it converts."""
    missing = PACKAGE.unavailable()
    if missing is not None:
        raise CaseError("dims.float8", f"null: {missing}", spec.recipe)
    rsf = case.reshard_after_forward
    check(
        not spec.all_gather or isinstance(rsf, bool),
        "reshard_after_forward",
        "true or false beside the float8 all-gather: FSDP2 gathers a tensor subclass from its post-forward"
        " shards with NotImplementedError (torch 2.13, FSDPParam.all_gather_inputs)",
        rsf,
    )
    check(
        case.compile is None or case.compile_backend != "inductor",
        "compile_backend",
        "aot_eager or eager beside float8 (Inductor's fusions of the float8 casts are not modelled: the"
        " reference's fusion bound, reference/fusion.py, does not read float8 tensors)",
        case.compile_backend,
    )
    linears = builtin_linears(case.model)
    shard = case.mesh[-1]
    uneven = uneven_rows(case.model, shard, spec) if spec.all_gather else []
    check(
        not uneven,
        "dims.float8.all_gather",
        f"false where a converted weight's rows do not divide over the shard group of {shard}: torchao 0.18's"
        " float8 all-gather sends each rank's unpadded shard, a collective of another size on the last rank"
        f" (pytorch/ao#3982; tests/upstream/test_torchao_float8_all_gather_uneven_shards.py; {uneven[0] if uneven else ''})",
        spec.all_gather,
    )
    if linears is not None and not any(converts(*linear, spec) for linear in linears):
        raise CaseError(
            "dims.float8",
            f"a model with an nn.Linear whose in and out features are multiples of {MULTIPLE}, untied and not"
            " skipped (torch._scaled_mm's shapes): none would be converted",
            case.model.kind,
        )


def _fit(width: int) -> int:
    """A drawn width as float8 takes it: a multiple of 16, 16 or 32 (the draws keep models tiny)."""
    return 16 if width <= 16 else 32


def float8_shapes(model):
    """`model` (a built-in one) with its widths made multiples of 16 (16 or 32), so that its
    linear layers convert: what the draw does to a model it draws float8 for."""
    if model.kind == "mlp":
        return replace(model, widths=tuple(_fit(w) for w in model.widths))
    if model.kind == "transformer":
        return replace(model, dim=_fit(model.dim), ffn_hidden=_fit(model.ffn_hidden))
    return model


def _draw(case, pins: dict[str, Any]):
    """Cases with float8 drawn on (about half, unless pinned) or off. On, what the together table
    draws off beside it is turned off (offload, Shard(1), a zoom, a resume) and a built-in model's
    widths are made multiples of 16 (its names, and so its plan, frozen and ignored
    parameters, unchanged); kept off beside another dimension, beside what is not drawn off (a
    user's step, routed experts), or where a pin asks for something it does not take."""
    from hypothesis import assume
    from hypothesis import strategies as st

    from fsdp_verify.dims.together import beside_another, drawn_off, pinned_beside, rows

    whole = pins.get(f"dims.{NAME}")
    if whole is not None and not isinstance(whole, st.SearchStrategy):
        if whole == Float8Spec():
            return st.just(case)
        pins = {**pins, **{f"dims.{NAME}.{f.name}": getattr(whole, f.name) for f in fields(whole)}}
    if PACKAGE.unavailable() is not None:
        return st.just(case)
    kept = [row for row in rows(NAME) if not row.drawn and not row.ok(case)]
    inductor = case.compile is not None and case.compile_backend == "inductor"  # `_validate`
    if kept or inductor or beside_another(NAME, case) or pinned_beside(NAME, case, pins):
        return st.just(case)

    def pinned(name: str, default):
        value = pins.get(f"dims.{NAME}.{name}", default)
        return value if isinstance(value, st.SearchStrategy) else st.just(value)

    @st.composite
    def drawn(draw):
        recipe = draw(pinned("recipe", st.sampled_from((None, *RECIPES))))
        if recipe is None:
            return case
        skip = draw(pinned("skip", st.just(())))
        model = float8_shapes(case.model) if builtin_linears(case.model) is not None else case.model
        rule = Float8Spec(recipe, True, skip=skip)
        gathers = (
            recipe == "tensorwise"
            and not uneven_rows(model, case.mesh[-1], rule)  # pytorch/ao#3982
            # an int reshard_after_forward the draw was pinned to stays (no float8 all-gather beside it)
            and ("reshard_after_forward" not in pins or isinstance(case.reshard_after_forward, bool))
            # gloo (the CPU) has no float8 all-gather: a unit of float8 weights alone is not drawn
            and not float8_only_units(case.with_(model=model), rule)
        )
        all_gather = draw(pinned("all_gather", st.sampled_from((True, False)) if gathers else st.just(False)))
        precompute = draw(pinned("precompute", st.sampled_from((True, False)) if all_gather else st.just(False)))
        assume(gathers or not all_gather)  # pinned on where it cannot be: another draw
        changes = {**drawn_off(NAME, case), f"dims.{NAME}": Float8Spec(recipe, all_gather, precompute, skip)}
        if model != case.model:
            changes["model"] = model
        if all_gather and not isinstance(case.reshard_after_forward, bool):
            changes["reshard_after_forward"] = True
        try:
            return case.with_(**changes)
        except CaseError:
            assume(False)
            raise

    return drawn()


GROUP = "float8 training, torchao (docs/float8.md)"

PACKAGE = DimensionPackage(
    name=NAME,
    what="float8 training",
    spec=Float8Spec,
    applies="convert_to_float8_training(model) before fully_shard: ShardSpec.convert",
    flags=(
        Flag(
            "--float8",
            "dims.float8.recipe",
            GROUP,
            f"torchao's recipe, one of {', '.join(RECIPES)} | none: every nn.Linear whose dims are multiples of 16"
            " trains in float8 (convert_to_float8_training)",
            or_none(str),
            "RECIPE",
        ),
        Flag(
            "--float8-all-gather",
            "dims.float8.all_gather",
            GROUP,
            "FSDP2 all-gathers the float8 weights in float8 (enable_fsdp_float8_all_gather; tensorwise)",
            boolean,
            "BOOL",
            const=True,
        ),
        Flag(
            "--float8-precompute",
            "dims.float8.precompute",
            GROUP,
            "the float8 all-gather's scales computed after each optimizer step by one all-reduce"
            " (precompute_float8_dynamic_scale_for_fsdp)",
            boolean,
            "BOOL",
            const=True,
        ),
        Flag(
            "--float8-skip",
            "dims.float8.skip",
            GROUP,
            "module names left in high precision (any module whose name contains one; torchtitan's filter_fqns)",
            names,
            "NAMES",
        ),
    ),
    validate=_validate,
    draw=_draw,
    not_modelled=(
        NotModelled("tp", 1, "tensor parallelism (torchao's float8 tp styles are not modelled)"),
        NotModelled("ep", 1, "expert parallelism"),
        NotModelled("pp", 1, "pipeline parallelism"),
        NotModelled("model.experts", 0, "routed experts", drawn=False),
        NotModelled("step", None, "a user's step (it would precompute the scales itself)", drawn=False),
        NotModelled("loss_scaling", None, "fp16 loss scaling", drawn=False),
        NotModelled("offload", False, "CPU offload"),
        NotModelled("shard_placement", "dim0", "Shard(1) placements (torchao's float8 all-gather shards dim 0)"),
        NotModelled("zoom", None, "a zoom"),
        NotModelled("resume_after", None, "a resume (its checkpoint of float8 weight wrappers)"),
    ),
    requires=(("torchao", "float8"),),
    runtime="fsdp_verify.dims.float8.runtime",
    mutants="fsdp_verify.dims.float8.mutants",
    docs="docs/float8.md",
)
