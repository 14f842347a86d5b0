"""Tensor parallelism: which plan a case's model is split by, and how an engine applies it.

A plan maps module FQNs to torch's ParallelStyles (`ColwiseParallel`, `RowwiseParallel`,
`SequenceParallel`, `PrepareModuleInput`). Where it comes from, in this order:

- the case's `tp_plan` ("pkg.module:NAME" or "file.py:NAME"): a dict of FQN (`*` matches one
  name of the path, as `parallelize_module` reads it) to ParallelStyle, or a function
  `NAME(model, tp_mesh) -> such a dict` (`tp_mesh` is None where no mesh exists: the
  reference, validation; a plan may read the model, not the mesh);
- a `transformers` model's own `base_model_tp_plan` (and the head's `_tp_plan`), its strings read
  as torch's styles (`STYLE_NAMES`);
- the built-in models' plans: the Transformer's is torchtitan's (`apply_tp` of its llama3
  recipe), with or without sequence parallelism and loss parallelism; the MLP's alternates
  colwise and rowwise layers (Megatron's pairing), the output gathered.

The sharded side applies a plan with `parallelize_module` on the mesh's "tp" dimension, before
`fully_shard` over the data-parallel dimensions (torchtitan's order: `apply_plan`, which
`ShardSpec.parallelize` calls). The reference reads the same plan's styles (data: their layouts)
and emulates them (reference/tensor_parallel.py). Plans are checked against the model on the
meta device (`check_plan`): every dimension a style splits must be a multiple of the degree, so a
case that cannot shard evenly is bad input naming the field, not a crash inside DTensor.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any

from torch import nn

from fsdp_verify.validation import CaseError

# A transformers plan's strings as torch's ParallelStyles (transformers registers its own classes
# under these names, `transformers.distributed.tensor_parallel`; these are their torch
# equivalents: the same layouts in and out).
STYLE_NAMES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise_split_input",
    "rowwise_rep",
    "sequence_parallel",
    "embedding_rowwise",
)


def _style(name: str, where: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    if name not in styles:
        raise CaseError(
            "tp_plan",
            f"a plan whose styles are among {STYLE_NAMES} (the model's own plan names {name!r} at {where})",
            name,
        )
    return styles[name]()


def transformer_plan(
    model: nn.Module,
    sequence_parallel: bool,
    loss_parallel: bool,
    projections: tuple[str, ...] = ("attention.wq", "attention.wk", "attention.wv"),
    head: str = "output",
    local_outputs: bool = True,
) -> dict[str, Any]:
    """torchtitan's plan for the built-in Transformer (its llama3 `apply_tp`): the vocabulary-
    sharded embedding, colwise q/k/v (`projections`, in each block) and feed-forward inputs,
    rowwise outputs, the head colwise (its output left sharded over the vocabulary under loss
    parallelism). With sequence parallelism the norms run on sequence shards and every block's
    input is gathered first. `local_outputs=False` keeps the embedding's and the rowwise layers'
    outputs DTensors (a model that runs its activations as DTensors between modules)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    between = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=between, use_local_output=local_outputs
        ),
        head: ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        block = {
            **{name: ColwiseParallel() for name in projections},
            "attention.wo": RowwiseParallel(output_layouts=between, use_local_output=local_outputs),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between, use_local_output=local_outputs),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            block.update(
                {
                    "attention_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                    ),
                    "ffn_norm": SequenceParallel(),
                    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
        plan.update({f"layers.{i}.{k}": v for k, v in block.items()})
    return plan


def mlp_plan(model: nn.Module) -> dict[str, Any]:
    """The built-in MLP: layer 0 colwise, layer 1 rowwise, and so on (the hidden activation stays
    sharded between a pair, its tanh and dropout on each rank's slice); a last colwise layer
    gathers its output, so the loss sees the whole of it."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    n = len(model.layers)
    plan: dict[str, Any] = {}
    for i in range(n):
        if i % 2:
            plan[f"layers.{i}.linear"] = RowwiseParallel()
        else:
            plan[f"layers.{i}.linear"] = (
                ColwiseParallel(output_layouts=Replicate()) if i == n - 1 else ColwiseParallel()
            )
    return plan


def hf_plan(model: nn.Module, loss_parallel: bool) -> dict[str, Any] | None:
    """A transformers model's own plan as torch's styles: the whole model's as transformers puts it
    together when it builds one (`model._tp_plan`: the base model's `config.base_model_tp_plan`
    under its prefix, its embedding's, the head's), else the config's base plan under the prefix
    and the class's head plan; None when it has none. Under loss parallelism the head (the
    class's `_tp_plan` entries) keeps its output sharded over the vocabulary."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    head = dict(getattr(type(model), "_tp_plan", None) or {})
    own = dict(getattr(model, "_tp_plan", None) or {})
    if not own:
        config = getattr(model, "config", None)
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        prefix = getattr(model, "base_model_prefix", "")
        has_base = bool(prefix) and hasattr(model, prefix)
        own = {**{(f"{prefix}.{k}" if has_base else k): v for k, v in base.items()}, **head}
    if not own:
        return None
    plan = {k: _style(v, k) for k, v in own.items()}
    if loss_parallel:
        for k in head:
            plan[k] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def plan_for(case, model: nn.Module, tp_mesh=None) -> dict[str, Any]:
    """The case's plan for `model` as built (module FQNs, wildcards expanded), in the order
    `parallelize_module` applies it. Raises CaseError naming `tp_plan` for a plan that is not one."""
    if case.tp_plan is not None:
        from fsdp_verify.imports import load_object

        given = load_object(case.tp_plan, "tp_plan", callable_only=False)
        plan = given(model, tp_mesh) if callable(given) else given
        if not isinstance(plan, dict):
            raise CaseError(
                "tp_plan", "a dict of module FQN to ParallelStyle, or a function returning one", case.tp_plan
            )
    elif case.model.is_custom:
        plan = hf_plan(model, case.loss_parallel)
        if plan is None:
            raise CaseError(
                "tp_plan",
                "a plan for a model without one of its own (FILE:NAME, a dict of FQN to ParallelStyle or a function"
                " of (model, tp_mesh) returning one; docs/tensor-parallel.md)",
                None,
            )
    elif case.model.kind == "mlp":
        plan = mlp_plan(model)
    else:
        plan = transformer_plan(model, case.sequence_parallel, case.loss_parallel)
    return expand(plan, model, case.tp_plan)


def expand(plan: dict[str, Any], model: nn.Module, source: str | None = None) -> dict[str, Any]:
    """Wildcard entries (`layers.*.mlp.up_proj`) replaced by the modules they match; an entry
    that matches no module is bad input naming `tp_plan`."""
    from torch.distributed.tensor.parallel import ParallelStyle

    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise CaseError("tp_plan", f"ParallelStyle values (at {pattern!r})", type(style).__name__)
        parts = pattern.split(".")
        matches = [
            n for n in names if len(n.split(".")) == len(parts) and all(map(fnmatch.fnmatchcase, n.split("."), parts))
        ]
        if not matches:
            raise CaseError("tp_plan", f"module names of the model ({pattern!r} matches none)", source or pattern)
        for n in matches:
            out[n] = style
    return out


def apply_plan(model: nn.Module, tp_mesh, plan: dict[str, Any]) -> None:
    """`parallelize_module` with the plan on the tp mesh: every style on its module."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, plan)


def split_parameters(case) -> dict[str, int]:
    """The parameters the case's plan splits over its tp ranks, each with the dim it splits (a
    colwise linear's weight and bias by rows, a rowwise one's weight by columns, an embedding by
    rows under RowwiseParallel and by columns under ColwiseParallel); the others stay whole on
    every tp rank (a rowwise bias, a SequenceParallel norm, a module the plan leaves alone)."""
    return dict(_split_parameters(case.model, case.tp, case.tp_plan, case.sequence_parallel, case.loss_parallel))


@functools.lru_cache(maxsize=64)
def _split_parameters(spec, tp: int, tp_plan, sequence_parallel: bool, loss_parallel: bool) -> tuple:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if tp == 1:
        return ()
    model, plan = _meta_plan(spec, tp, tp_plan, sequence_parallel, loss_parallel)
    out = []
    for fqn, style in plan.items():
        module = model.get_submodule(fqn)
        embedding = isinstance(module, nn.Embedding)
        for name, _ in module.named_parameters(recurse=False):
            if isinstance(style, ColwiseParallel):
                out.append((f"{fqn}.{name}", 1 if embedding else 0))
            elif isinstance(style, RowwiseParallel) and name == "weight":
                out.append((f"{fqn}.{name}", 0 if embedding else 1))
    return tuple(out)


def tp_mesh_parameters(case) -> frozenset[str]:
    """The parameters the case's plan puts on the tp mesh: those of the modules a ColwiseParallel,
    RowwiseParallel or SequenceParallel style distributes. The others (a norm the plan leaves
    alone, without sequence parallelism) FSDP2 shards over the data-parallel mesh only: a clip
    then takes the two meshes' norms apart (`EngineView.clip_grad_norm_`)."""
    return _tp_mesh_parameters(case.model, case.tp, case.tp_plan, case.sequence_parallel, case.loss_parallel)


@functools.lru_cache(maxsize=64)
def _tp_mesh_parameters(spec, tp: int, tp_plan, sequence_parallel: bool, loss_parallel: bool) -> frozenset[str]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if tp == 1:
        return frozenset()
    model, plan = _meta_plan(spec, tp, tp_plan, sequence_parallel, loss_parallel)
    distributing = (ColwiseParallel, RowwiseParallel, SequenceParallel)
    return frozenset(
        f"{fqn}.{name}"
        for fqn, style in plan.items()
        if isinstance(style, distributing)
        for name, _ in model.get_submodule(fqn).named_parameters(recurse=False)
    )


def _meta_plan(spec, tp: int, tp_plan, sequence_parallel: bool, loss_parallel: bool) -> tuple[nn.Module, dict]:
    """The model built on the meta device and its plan, from the fields the plan follows from."""
    import torch

    from fsdp_verify.models import _construct

    with torch.device("meta"):
        model = _construct(spec)
    return model, plan_for(_PlanOf(spec, tp, tp_plan, sequence_parallel, loss_parallel), model)


@functools.lru_cache(maxsize=64)
def sequence_parallel_modules(spec, tp: int, tp_plan, sequence_parallel: bool, loss_parallel: bool) -> frozenset:
    from torch.distributed.tensor.parallel import SequenceParallel

    _, plan = _meta_plan(spec, tp, tp_plan, sequence_parallel, loss_parallel)
    return frozenset(fqn for fqn, style in plan.items() if isinstance(style, SequenceParallel))


# pytorch/pytorch#190626 (open): FSDP2 sums a SequenceParallel module's partial weight gradients
# over the tp ranks in param_dtype, not reduce_dtype. Measured on torch 2.13.0 and 2.14.1 (the
# repro xfails on both; `check --tp 2 --sequence-parallel --param-dtype bf16 --reduce-dtype fp32
# --vocab-size 64` parts there at 1.5e3x). Left out of the draw (properties/tensor_parallel.py `tp_styles`).
REDUCE_DTYPE_REPRO = "tests/upstream/test_fsdp2_tp_reduce_dtype.py"


def reduce_dtype_hint(case, first) -> str:
    """Where the first record to part is the gradient of a SequenceParallel module's parameter
    (the one gradient summed over the tp ranks) and the case has every ingredient of #190626 (a
    param_dtype below reduce_dtype): that bug, named; else nothing."""
    if first is None or first.ok or first.phase != "grads" or case.tp == 1:
        return ""  # (a plan of the user's may have SequenceParallel modules without the flag)
    p = case.precision
    if p.param_dtype in (None, "fp32") or p.reduce_dtype in (None, p.param_dtype):
        return ""
    spec = (case.model, case.tp, case.tp_plan, case.sequence_parallel, case.loss_parallel)
    if first.name.rpartition(".")[0] not in sequence_parallel_modules(*spec):
        return ""
    return (
        f"the first gradient to part, {first.name}, is a sequence-parallel module's, the one gradient summed over"
        f" the tp ranks; with param_dtype {p.param_dtype} and reduce_dtype {p.reduce_dtype} this case has every"
        " ingredient of a known PyTorch bug: FSDP2 runs that sum in param_dtype (pytorch/pytorch#190626, open;"
        f" torch 2.13.0 and 2.14.1). Repro: {REDUCE_DTYPE_REPRO}"
    )


@dataclasses.dataclass(frozen=True)
class _PlanOf:
    """The fields of a case its plan follows from (`plan_for` reads these)."""

    model: Any
    tp: int
    tp_plan: str | None
    sequence_parallel: bool
    loss_parallel: bool


def divisions(plan: dict[str, Any], model: nn.Module) -> list[tuple[str, str, int]]:
    """(module, what a style splits, its size) for every dimension the plan cuts over the tp ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = []
    for fqn, style in plan.items():
        module = model.get_submodule(fqn)
        if isinstance(module, nn.Linear):
            if isinstance(style, ColwiseParallel):
                out.append((fqn, "out_features", module.out_features))
            elif isinstance(style, RowwiseParallel):
                out.append((fqn, "in_features", module.in_features))
        elif isinstance(module, nn.Embedding):
            if isinstance(style, RowwiseParallel):
                out.append((fqn, "num_embeddings", module.num_embeddings))
            elif isinstance(style, ColwiseParallel):
                out.append((fqn, "embedding_dim", module.embedding_dim))
    return out


def check_plan(case) -> None:
    """Raise CaseError (naming the field to change) unless the case's plan splits its model evenly
    over `case.tp` ranks: every sharded dimension, the attention heads (each rank computes whole
    heads: `n_heads`, a transformers config's `num_attention_heads` and `num_key_value_heads`)
    and, under sequence parallelism, the sequence."""
    import torch
    from torch.distributed.tensor.parallel import SequenceParallel

    from fsdp_verify.models import _construct

    with torch.device("meta"):
        model = _construct(case.model)
    plan = plan_for(case, model)
    tp = case.tp
    spec = case.model
    if spec.kind == "transformer" and spec.n_heads % tp:
        raise CaseError("model.n_heads", f"a multiple of tp={tp} (each rank computes whole heads)", spec.n_heads)
    if spec.kind != "mlp" and any(isinstance(s, SequenceParallel) for s in plan.values()) and spec.seq_len % tp:
        raise CaseError(
            "model.seq_len", f"a multiple of tp={tp} (sequence parallelism splits the sequence)", spec.seq_len
        )
    config = getattr(model, "config", None)
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % tp:
            raise CaseError("model.kwargs", f"{name} a multiple of tp={tp} (each rank computes whole heads)", heads)
    for fqn, what, size in divisions(plan, model):
        if size % tp:
            field = _field_of(case, fqn, what)
            raise CaseError(field, f"a multiple of tp={tp} ({fqn}.{what} = {size} is split over the tp ranks)", size)


def _field_of(case, fqn: str, what: str) -> str:
    """The case field that sets a split dimension of a built-in model; `tp` otherwise."""
    spec = case.model
    if spec.kind == "transformer":
        if what == "num_embeddings" or fqn == "output":
            return "model.vocab_size"
        if fqn.endswith(("w1", "w2", "w3")):
            return "model.ffn_hidden"
        return "model.dim"
    if spec.kind == "mlp":
        return "model.widths"
    return "tp"
