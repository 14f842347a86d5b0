"""Finding: one judgement of one record (or one check), with its deviation and the tolerance it
was held to. Comparators and checks make them; the Verdict orders them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fsdp_verify.trace import Key


@dataclass
class Finding:
    step: int
    phase: str
    name: str
    ok: bool
    kind: str  # "deviation" | "missing" | "unexpected" | "shape" | "nonfinite"
    comparator: str
    message: str = ""
    max_abs: float = 0.0
    normwise: float = 0.0
    max_rel: float = 0.0
    max_ulp: int = 0
    tolerance: float = 0.0
    mode: str = ""
    why: str = ""

    @property
    def ratio(self) -> float:
        """Deviation over tolerance: > 1 fails. inf for an exact record that moved at all, and for
        a failed non-numeric finding; 0 for a passing one (a warning or note)."""
        if self.kind != "deviation":
            return 0.0 if self.ok else float("inf")
        if self.tolerance == 0:
            return 0.0 if self.normwise == 0 else float("inf")
        return self.normwise / self.tolerance

    @property
    def key(self) -> Key:
        return (self.step, self.phase, self.name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d
