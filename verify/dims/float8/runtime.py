"""Float8's hooks (verify/dims/registry.py): the conversion on the ranks and in the reference, the
reference's compute dtypes, the loop's step after the optimizer's, and the knobs check.

Why the reference is the same conversion on one device: torchao's tensorwise recipe scales each
cast by the amax of the tensor it casts. On a rank, FSDP2 all-gathers the weight first, so the
weight's amax is over the whole tensor, as on one device; with the float8 all-gather each shard
is cast before the gather, by a scale from the shards' amaxes all-reduced (MAX is exact, and the
scale is the same float64 division as `amax_to_scale`'s), so the gathered bytes are those of the
whole tensor cast at once. The inputs' and the output gradients' amaxes are each rank's own
micro-batch's, and the reference runs each rank's micro-batch apart. So the reference converts
its model alike and computes the same casts, bit for bit (measured: tests/test_float8.py).

One difference is modelled (`compute_dtypes`): with the float8 all-gather FSDP2's `param_dtype`
never applies to a converted weight (torchao casts the fp32 shard straight to float8 in
`fsdp_pre_all_gather`), while without it FSDP2 casts the weight to `param_dtype` first and the
float8 cast starts from those rounded values. The reference computes with such a weight in fp32
where the ranks do (measured: bf16 with the all-gather differs by 0.05 after three steps
otherwise, bit-exact with it).
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_verify import module_names
from fsdp_verify.dims.float8 import Float8Spec, converts


def config(spec: Float8Spec, all_gather: bool | None = None):
    """torchao's `Float8LinearConfig` for `spec` (`all_gather` overrides its float8 all-gather)."""
    from torchao.float8 import Float8LinearConfig

    gather = spec.all_gather if all_gather is None else all_gather
    if spec.recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=gather)
    return Float8LinearConfig.from_recipe_name(spec.recipe)


def converted_names(model: nn.Module, spec: Float8Spec) -> list[str]:
    """The modules `spec` converts in `model` (their names as the model's, wrappers read through):
    every nn.Linear, subclasses included (the built-in models' `Linear`, as torchao's swap takes
    them), not yet converted, that the rule takes."""
    from torchao.float8.float8_linear import Float8Linear

    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    out = []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, Float8Linear):
            shared = counts.get(id(module.weight), 0) > 1
            name = module_names.original(fqn)
            if converts(name, module.in_features, module.out_features, shared, spec):
                out.append(fqn)
    return out


def _convert(model: nn.Module, spec: Float8Spec, all_gather: bool | None = None) -> nn.Module:
    from torchao.float8 import convert_to_float8_training

    chosen = set(converted_names(model, spec))
    return convert_to_float8_training(
        model, config=config(spec, all_gather), module_filter_fn=lambda _m, fqn: fqn in chosen
    )


def convert(model: nn.Module, mesh, spec: Float8Spec, case) -> None:
    """On the ranks, before anything else is applied (torchtitan's model converters run first).
    Over gloo a unit of float8 weights alone is named before FSDP2 fails on it unexplained."""
    import torch.distributed as dist

    from fsdp_verify.dims.float8 import float8_only_units

    alone = float8_only_units(case, spec)
    if alone and dist.is_initialized() and dist.get_backend() == "gloo":
        raise ValueError(
            f"dims.float8.all_gather: unit {alone[0] or '<root>'!r} holds float8 weights alone, which FSDP2 then"
            " all-gathers in float8 and gloo cannot (RuntimeError: Invalid scalar type); on the CPU put a"
            " parameter of another dtype in each unit, or turn the float8 all-gather off"
        )
    _convert(model, spec)


def convert_reference(model: nn.Module, spec: Float8Spec, case) -> None:
    """The reference's model: the same modules converted, the same casts (no all-gather to do);
    watched when float8's own check runs it (rounding.py)."""
    from fsdp_verify.dims.float8 import rounding

    _convert(model, spec, all_gather=False)
    rounding.attach_if_watching(model)


def own_check(spec: Float8Spec, case) -> list:
    """Float8's own check: each float8 product of the reference against the rounding of its casts."""
    from fsdp_verify.dims.float8 import rounding

    return rounding.check(spec, case)


def compute_dtypes(model: nn.Module, spec: Float8Spec, case) -> dict[str, torch.dtype]:
    """Parameters the forward computes with in another dtype than `param_dtype`: with the float8
    all-gather, each converted weight in fp32 (its master shard cast to float8 directly)."""
    if not spec.all_gather:
        return {}
    names = converted_names_after(model)
    return {f"{fqn}.weight" if fqn else "weight": torch.float32 for fqn in names}


def converted_names_after(model: nn.Module) -> list[str]:
    """The modules of `model` torchao converted (after the conversion)."""
    from torchao.float8.float8_linear import Float8Linear

    return [fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]


def after_optimizer_step(module: nn.Module, spec: Float8Spec, case) -> None:
    """The loop's step after each optimizer step: the float8 all-gather's scales for the next
    step, one all-reduce for all weights (torchtitan's float8 converter's post-optimizer hook)."""
    if spec.precompute:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(module)


def applied(model: nn.Module, spec: Float8Spec, case) -> str | None:
    """Evidence that the engine did not apply float8 as the case asks, or None: a module the rule
    converts left an nn.Linear, or a weight without (or with) the float8 all-gather's wrapper."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    left = converted_names(model, spec)
    if left:
        name = module_names.original(left[0])
        return f"{name} is an nn.Linear: not converted (convert_to_float8_training before fully_shard)"
    for fqn, module in model.named_modules():
        name = module_names.original(fqn)
        if isinstance(module, Float8Linear):
            weight = module.weight
            local = weight._local_tensor if isinstance(weight, DTensor) else weight
            wrapped = isinstance(local, WeightWithDynamicFloat8CastTensor)
            if wrapped != spec.all_gather:
                return (
                    f"{name}.weight is {'' if wrapped else 'not '}all-gathered in float8, the case asks"
                    f" all_gather={spec.all_gather} (Float8LinearConfig.enable_fsdp_float8_all_gather)"
                )
    return None


# ---- the communication contract (verify/checks/comm.py) -----------------------------------------
def built(module: nn.Module, spec: Float8Spec, case) -> list[str]:
    """The modules the engine converted (their names as the model's): the trace keeps them."""
    return [module_names.original(fqn) for fqn in converted_names_after(module)]


def all_gather(params: list[tuple[str, list[int]]], first: bool, converted: list[str] | None, spec: Float8Spec, case):
    """What the float8 all-gather changes in one unit's all-gather, FSDP2's `foreach_all_gather`
    with torchao's `fsdp_pre_all_gather`: each converted weight's shard goes as float8 (1 B an
    element; inputs of several dtypes make FSDP2 gather them all as uint8 bytes), and, unless its
    scale was precomputed, casting it takes the shard group's all-reduce of its amax first (one
    fp32 scalar a weight, `tensor_to_amax(reduce_amax=True)`; over a shard group of one rank too,
    where FSDP2 gathers nothing). The precomputed scales come after the first optimizer step: the
    `first` step trained casts as without. Only from the unit's full shards:
    a unit gathered from its post-forward shards (an int `reshard_after_forward`) gathers the
    float8 bytes kept from forward and casts nothing. Returns ({param: dtype}, [(kind, dtype,
    bytes)] per gather from the full shards); nothing without the float8 all-gather."""
    if not spec.all_gather:
        return {}, []
    weights = {f"{fqn}.weight" for fqn in converted or ()}
    mine = [n for n, _ in params if n in weights]
    amaxes = [] if spec.precompute and not first else [("all_reduce", "fp32", 4)] * len(mine)
    return dict.fromkeys(mine, "float8_e4m3fn"), amaxes


def gather_metadata(
    params: list[tuple[str, list[int]]], first: bool, converted: list[str] | None, spec: Float8Spec, case
) -> dict[str, int]:
    """What one all-gather of the unit leaves on its parameters until they are copied out, by
    storage: torchao's `fsdp_pre_all_gather` returns each converted weight's scale as FSDP2's
    metadata, which FSDP2 keeps on the parameter (`ExtensionsData`) until its
    `fsdp_post_all_gather`. A scale cast on the spot is a new fp32 scalar (4 B a weight); a
    precomputed one (after the first step) is a view of the one tensor
    `precompute_float8_dynamic_scale_for_fsdp` made for every converted weight, whose whole storage
    it keeps (4 B a converted weight of the model, once, however many units hold a view), and the
    next precompute has replaced it on the weights by then. A gather nobody waits on (a unit
    backward reaches only by a prefetch: verify/checks/comm.py `prefetched_only`) leaves it there
    until the next forward's copy-out (measured, torch 2.13, torchao 0.18: 4 B after the first
    optimizer step, 8 B after later ones with two converted weights,
    tests/regressions/30f308dbc7bb.json)."""
    if not spec.all_gather:
        return {}
    weights = {f"{fqn}.weight" for fqn in converted or ()}
    mine = [n for n, _ in params if n in weights]
    if not mine:
        return {}
    if spec.precompute and not first:
        return {"precomputed scales": 4 * len(weights)}
    return dict.fromkeys(mine, 4)
