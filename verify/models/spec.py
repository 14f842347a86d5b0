"""ModelSpec: which model a Case trains (a built-in one and its sizes, or a user's factory by
import path with its JSON kwargs), so a Case file replays the same model anywhere. Validation
names the field."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fsdp_verify.validation import check, is_int, is_number

MODEL_KINDS = ("mlp", "transformer", "custom")
IMPORT_PATH = "'pkg.module:NAME' or 'path/to/file.py:NAME'"


def is_import_path(value: Any) -> bool:
    return isinstance(value, str) and ":" in value and all(value.rsplit(":", 1))


@dataclass(frozen=True)
class ModelSpec:
    """Built-in model: `mlp` uses `widths` (input, hidden..., output); `transformer` the sizes
    below. `custom`: `factory(**kwargs) -> nn.Module`, called under `torch.manual_seed(case.seed)`
    on the reference and on every rank; `init_fn(model, generator)` (optional) initialises after;
    `output_fn(output) -> logits` (optional) picks the logits out of what forward returns;
    `shrinkable` names integer kwargs the shrinker may lower (layers, widths). `seq_len` is the
    length of the generated token sequences for both a Transformer and a custom LM."""

    kind: str = "transformer"
    widths: tuple[int, ...] = (16, 33, 17, 8)
    vocab_size: int = 61
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 44
    seq_len: int = 8
    tie_embeddings: bool = False
    dropout: float = 0.0
    frozen: tuple[str, ...] = ()  # parameter-name prefixes with requires_grad=False
    factory: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    init_fn: str | None = None
    output_fn: str | None = None
    shrinkable: tuple[str, ...] = ()
    # MLP: routed experts after the first block, each sample sent to one (docs/optimizers-and-schedules.md).
    experts: int = 0
    # The grouped experts' routing (verify/models/moe.py, docs/expert-parallel.md): each sample
    # sent to its `top_k` experts, all experts in one (experts, dim, dim) weight, as expert
    # parallelism shards them. None: the per-expert loop above (top-1).
    top_k: int | None = None
    # At most ceil(capacity_factor * tokens * top_k / experts) assignments an expert and rank, the
    # rest dropped; None: dropless.
    capacity_factor: float | None = None
    # The load-balancing loss's coefficient (over the global micro-batch); 0: none.
    aux_loss: float = 0.0
    # Aux-loss-free balancing: the router bias's step per optimizer step (DeepSeek-V3); 0: none.
    router_bias: float = 0.0

    # Fields of a custom model, left out of the JSON (and so of the Case hash) while at their
    # defaults: a built-in case keeps the hash and the file it had before they existed.
    OPTIONAL_FIELDS = (
        "factory",
        "kwargs",
        "init_fn",
        "output_fn",
        "shrinkable",
        "experts",
        "top_k",
        "capacity_factor",
        "aux_loss",
        "router_bias",
    )
    BUILTIN_FIELDS = ("widths", "vocab_size", "dim", "n_layers", "n_heads", "ffn_hidden", "tie_embeddings")

    def __hash__(self) -> int:  # kwargs is a dict: hash the canonical JSON of every field
        return hash(json.dumps(self.__dict__, sort_keys=True, default=list))

    def validate(self, prefix: str = "model") -> None:
        check(self.kind in MODEL_KINDS, f"{prefix}.kind", f"one of {MODEL_KINDS}", self.kind)
        if self.kind == "mlp":
            check(
                len(self.widths) >= 2 and all(is_int(w) and w >= 1 for w in self.widths),
                f"{prefix}.widths",
                "at least two positive integers (input, ..., output)",
                self.widths,
            )
        elif self.kind == "transformer":
            for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_hidden", "seq_len"):
                value = getattr(self, name)
                check(is_int(value) and value >= 1, f"{prefix}.{name}", "a positive integer", value)
            check(self.dim % self.n_heads == 0, f"{prefix}.dim", f"a multiple of n_heads={self.n_heads}", self.dim)
            check(
                (self.dim // self.n_heads) % 2 == 0,
                f"{prefix}.dim",
                "an even head dimension (RoPE rotates pairs)",
                self.dim,
            )
        else:
            self._validate_custom(prefix)
        check(
            is_int(self.experts) and self.experts >= 0 and (self.experts == 0 or self.kind == "mlp"),
            f"{prefix}.experts",
            "0, or a positive number of experts for an MLP",
            self.experts,
        )
        self._validate_grouped_experts(prefix)
        if self.kind != "custom":
            check(self.factory is None, f"{prefix}.factory", "null unless kind is 'custom'", self.factory)
        check(
            is_number(self.dropout) and 0.0 <= self.dropout < 1.0,
            f"{prefix}.dropout",
            "a probability in [0, 1)",
            self.dropout,
        )

    def _validate_grouped_experts(self, prefix: str) -> None:
        k = self.top_k
        check(
            k is None or (is_int(k) and 1 <= k <= max(self.experts, 1) and self.experts > 0),
            f"{prefix}.top_k",
            f"null, or with routed experts a number of experts per sample in [1, experts={self.experts}]",
            k,
        )
        grouped = k is not None
        cf = self.capacity_factor
        check(
            cf is None or (grouped and is_number(cf) and cf > 0),
            f"{prefix}.capacity_factor",
            "null (dropless), or with top_k a positive factor",
            cf,
        )
        for name in ("aux_loss", "router_bias"):
            value = getattr(self, name)
            check(
                is_number(value) and value >= 0 and (value == 0 or grouped),
                f"{prefix}.{name}",
                "0, or with top_k a non-negative coefficient",
                value,
            )

    @property
    def grouped_experts(self) -> dict | None:
        """The grouped experts' routing as `GroupedMoE` takes it, or None (the per-expert loop)."""
        if not self.experts or self.top_k is None:
            return None
        return {
            "top_k": self.top_k,
            "capacity_factor": self.capacity_factor,
            "aux_loss": self.aux_loss,
            "router_bias": self.router_bias,
        }

    def _validate_custom(self, prefix: str) -> None:
        check(is_import_path(self.factory), f"{prefix}.factory", IMPORT_PATH, self.factory)
        check(isinstance(self.kwargs, dict), f"{prefix}.kwargs", "a JSON object of keyword arguments", self.kwargs)
        try:
            json.dumps(self.kwargs)
        except (TypeError, ValueError):
            check(False, f"{prefix}.kwargs", "JSON values (numbers, strings, lists, objects)", self.kwargs)
        for name in ("init_fn", "output_fn"):
            value = getattr(self, name)
            check(value is None or is_import_path(value), f"{prefix}.{name}", f"null or {IMPORT_PATH}", value)
        check(is_int(self.seq_len) and self.seq_len >= 1, f"{prefix}.seq_len", "a positive integer", self.seq_len)
        for name in self.shrinkable:
            check(
                is_int(self.kwargs.get(name)) and self.kwargs[name] >= 1,
                f"{prefix}.shrinkable",
                f"names of positive integer kwargs (kwargs has {sorted(self.kwargs)})",
                name,
            )

    @property
    def n_blocks(self) -> int:
        return len(self.widths) - 1 if self.kind == "mlp" else self.n_layers

    @property
    def is_custom(self) -> bool:
        return self.kind == "custom"
