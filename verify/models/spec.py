"""ModelSpec: which built-in model a Case trains, and its sizes. Validation names the field."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_verify.validation import check, is_int, is_number

MODEL_KINDS = ("mlp", "transformer")


@dataclass(frozen=True)
class ModelSpec:
    """Built-in model. `mlp` uses `widths` (input, hidden..., output); `transformer` the rest."""

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

    def validate(self, prefix: str = "model") -> None:
        check(self.kind in MODEL_KINDS, f"{prefix}.kind", f"one of {MODEL_KINDS}", self.kind)
        if self.kind == "mlp":
            check(
                len(self.widths) >= 2 and all(is_int(w) and w >= 1 for w in self.widths),
                f"{prefix}.widths",
                "at least two positive integers (input, ..., output)",
                self.widths,
            )
        else:
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
        check(
            is_number(self.dropout) and 0.0 <= self.dropout < 1.0,
            f"{prefix}.dropout",
            "a probability in [0, 1)",
            self.dropout,
        )

    @property
    def n_blocks(self) -> int:
        return len(self.widths) - 1 if self.kind == "mlp" else self.n_layers
