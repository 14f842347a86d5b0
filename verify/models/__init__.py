"""Built-in models: definitions only. How they are sharded lives in `verify/engines/`.

Both sides of a comparison build the model with `build_model`, which constructs it and then
initialises every parameter from `seed` in a fixed order (`init_weights`), so eager and meta-device
construction give the same values no matter how much randomness construction itself consumed
(seed 004, finding 3).
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_verify.models import custom
from fsdp_verify.models.mlp import MLP
from fsdp_verify.models.spec import MODEL_KINDS, ModelSpec
from fsdp_verify.models.transformer import Transformer

__all__ = [
    "MLP",
    "MODEL_KINDS",
    "ModelSpec",
    "Transformer",
    "build_model",
    "is_frozen",
    "is_ignored",
    "parameter_names",
    "default_wrap_plan",
    "module_classes",
    "module_names",
]


def _construct(spec: ModelSpec) -> nn.Module:
    if spec.is_custom:
        return custom.construct(spec)
    if spec.kind == "mlp":
        return MLP(spec.widths, dropout=spec.dropout, experts=spec.experts, moe=spec.grouped_experts)
    return Transformer(
        vocab_size=spec.vocab_size,
        dim=spec.dim,
        n_layers=spec.n_layers,
        n_heads=spec.n_heads,
        ffn_hidden=spec.ffn_hidden,
        seq_len=spec.seq_len,
        tie_embeddings=spec.tie_embeddings,
        dropout=spec.dropout,
    )


def build_model(spec: ModelSpec, seed: int, init: str = "eager", device: str | torch.device = "cpu") -> nn.Module:
    """Construct and initialise. `init="meta"` constructs on the meta device and materialises
    with `to_empty`; both modes then draw every initial value from `seed` on the CPU generator
    (CPU and CUDA generators differ for one seed: seed 004, finding 1), then move to `device`.
    A custom model is built by its factory under `torch.manual_seed(seed)` (its modules' own
    initialisation draws from the global generator, as transformers' models do), then the
    user's `init_fn`, if any."""
    if spec.is_custom:
        torch.manual_seed(seed)
        if init == "meta":  # validated: only with an init_fn, which must set every value
            with torch.device("meta"):
                model = _construct(spec)
            model.to_empty(device="cpu")
        else:
            model = _construct(spec)
        custom.initialise(model, spec, seed)
    elif init == "meta":
        with torch.device("meta"):
            model = _construct(spec)
        model.to_empty(device="cpu")
    else:
        model = _construct(spec)
    if not spec.is_custom:
        model.init_weights(torch.Generator().manual_seed(seed))
    for name, p in model.named_parameters():
        if is_frozen(spec, name):
            p.requires_grad_(False)
    return model.to(device)


def is_frozen(spec: ModelSpec, name: str) -> bool:
    """Whether parameter `name` is one `spec.frozen` names (itself or a prefix of it): frozen
    when built, trained from a case's `unfreeze_step` on."""
    return any(name == f or name.startswith(f + ".") for f in spec.frozen)


def is_ignored(ignored: tuple[str, ...], name: str) -> bool:
    """Whether parameter `name` is one a case's `ignored` prefixes name (`fully_shard`'s
    `ignored_params`: unsharded, unreduced, unmanaged)."""
    return any(name == f or name.startswith(f + ".") for f in ignored)


_PARAMETER_NAMES_CACHE: dict[ModelSpec, tuple[str, ...]] = {}


def parameter_names(spec: ModelSpec) -> tuple[str, ...]:
    """Every parameter's FQN, tied weights once under their first name, from a meta-device build."""
    if spec not in _PARAMETER_NAMES_CACHE:
        with torch.device("meta"):
            model = _construct(spec)
        _PARAMETER_NAMES_CACHE[spec] = tuple(name for name, _ in model.named_parameters())
    return _PARAMETER_NAMES_CACHE[spec]


_MODULE_CLASSES_CACHE: dict[ModelSpec, dict[str, str]] = {}


def module_classes(spec: ModelSpec) -> dict[str, str]:
    """Every module FQN ("" is the root) with its class name, from a meta-device build (no memory)."""
    if spec not in _MODULE_CLASSES_CACHE:
        if spec.is_custom:
            _MODULE_CLASSES_CACHE[spec] = custom.info(spec).classes
        else:
            with torch.device("meta"):
                model = _construct(spec)
            _MODULE_CLASSES_CACHE[spec] = {name: type(m).__name__ for name, m in model.named_modules()}
    return _MODULE_CLASSES_CACHE[spec]


def module_names(spec: ModelSpec) -> frozenset[str]:
    """All module FQNs of the model ("" is the root)."""
    return frozenset(module_classes(spec))


def default_wrap_plan(spec: ModelSpec) -> tuple[str, ...]:
    """Every block its own shard unit, then the root (torchtitan's plan); a custom model: the
    root only (name its blocks with `--wrap CLASS`)."""
    if spec.is_custom:
        return ("",)
    # The grouped experts are a unit of their own (as expert parallelism needs them: their
    # parameters live on another mesh than the dense ones).
    experts = ("moe.experts",) if spec.grouped_experts is not None else ()
    return experts + tuple(f"layers.{i}" for i in range(spec.n_blocks)) + ("",)
