"""A user's model: `factory(**kwargs) -> nn.Module` named by import path in the ModelSpec.

What the rest of the toolkit needs to know about it (module names and classes for wrap plans,
tied parameters, the vocabulary for generated token ids, whether forward takes an attention
mask) is read once per spec from a meta-device build, which costs no memory."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_verify.imports import load_object
from fsdp_verify.models.moe import experts_held, grouped_experts_modules
from fsdp_verify.models.spec import ModelSpec
from fsdp_verify.validation import CaseError

# What torchrun sets in every process it starts (pool workers set them too: verify/sharded/worker.py).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@contextlib.contextmanager
def as_one_process_launch() -> Iterator[None]:
    """Outside a rank (the reference, the meta-device build that reads the model's layout), the
    variables a one-process torchrun would set, unless a launcher set them already. A factory that
    reads `os.environ["RANK"]` then builds here as it does under torchrun, not a KeyError refused
    as bad input, and on the ranks it builds by rank, which the build check names at step 0."""
    if "RANK" in os.environ:
        yield
        return
    saved = {k: os.environ.get(k) for k in LAUNCHER_VARIABLES}
    os.environ.update(dict.fromkeys(("RANK", "LOCAL_RANK"), "0"), WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def construct(spec: ModelSpec) -> nn.Module:
    """Call the factory. Whatever it raises becomes a CaseError naming `model.factory`."""
    factory = load_object(spec.factory, "model.factory")
    try:
        with as_one_process_launch():
            model = factory(**spec.kwargs)
    except Exception as e:
        raise CaseError(
            "model.factory",
            f"a factory that builds the model from kwargs (it raised {type(e).__name__}: {e})",
            spec.factory,
        ) from e
    if not isinstance(model, nn.Module):
        raise CaseError(
            "model.factory", "a factory returning an nn.Module", f"{spec.factory} -> {type(model).__name__}"
        )
    return model


def initialise(model: nn.Module, spec: ModelSpec, seed: int) -> None:
    """The user's `init_fn(model, generator)`, with a CPU generator seeded from the case."""
    if spec.init_fn is not None:
        init = load_object(spec.init_fn, "model.init_fn")
        with torch.no_grad():
            init(model, torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class ModelInfo:
    classes: dict[str, str]  # module FQN -> class name ("" is the root)
    vocab_size: int | None  # rows of the input embedding, None without one
    takes_attention_mask: bool
    tied: tuple[tuple[str, ...], ...]  # names that share one parameter (tied embeddings)
    first_input: str  # the name of forward's first parameter (transformers: input_ids)
    # Modules whose training forward updates buffers (BatchNorm's running statistics): what
    # activation checkpointing would update a second time (verify/case_rules.py refuses that).
    running_stats: tuple[str, ...] = ()
    # Grouped experts modules (verify/models/moe.py `experts_held`): (module FQN, experts held),
    # what expert parallelism shards.
    grouped_experts: tuple[tuple[str, int], ...] = ()


def info(spec: ModelSpec) -> ModelInfo:
    return _info(spec)


@functools.lru_cache(maxsize=64)
def _info(spec: ModelSpec) -> ModelInfo:
    with torch.device("meta"):
        model = construct(spec)
    classes = {name: type(m).__name__ for name, m in model.named_modules()}
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    tied = tuple(tuple(names) for names in by_tensor.values() if len(names) > 1)
    names = _forward_parameters(model)
    first = next(iter(names), "input_ids")
    stats = tuple(
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
    )
    experts = tuple((name, experts_held(m)) for name, m in grouped_experts_modules(model))
    return ModelInfo(classes, _vocab_size(model), "attention_mask" in names, tied, first, stats, experts)


def tied_groups(spec: ModelSpec) -> tuple[tuple[str, ...], ...]:
    return _info(spec).tied


def running_stats(spec: ModelSpec) -> tuple[str, ...]:
    return _info(spec).running_stats


def _vocab_size(model: nn.Module) -> int | None:
    """From `get_input_embeddings()` (transformers' models) or else the first nn.Embedding."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = None
    if callable(getter):
        try:
            embedding = getter()
        except (NotImplementedError, AttributeError):
            embedding = None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None


def _forward_parameters(model: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return []


def logits_of(spec: ModelSpec, output: Any) -> torch.Tensor:
    """The logits in what forward returned: the user's `output_fn`, else a tensor itself, a
    `ModelOutput`'s `.logits`, or the first element of a tuple."""
    if spec.output_fn is not None:
        return load_object(spec.output_fn, "model.output_fn")(output)
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"model.output_fn: the model returned {type(output).__name__}; name a function that returns its logits"
    )
