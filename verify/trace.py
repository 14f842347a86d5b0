"""Trace: what one run recorded, in one schema for the reference and the sharded side.

Records are full (unsharded) tensors keyed by (step, phase, name). Step 0 holds the initial
state; steps 1..N the training steps. Phases are listed in execution order, which is the order
the first divergence is searched in. Stored as safetensors (tensors) with the JSON metadata in the
safetensors header: no pickle, so a Trace file from a stranger is safe to open.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

# Execution order within a step: the order the first divergence is searched in. Step 0 holds
# "ownership" (who owns each parameter), "init" and "param_sums"; "buffers" are recorded at step 0
# and after each step; "precision" holds the dtypes seen during a step's forward and backward, and
# at step 0 the dtype the sharded parameters are held in, which explains their values and so
# comes before "init" (master weights held in bf16 are a precision finding, not "ranks
# initialised differently").
# "loss_scale" (fp16 dynamic loss scaling: each rank's scale and skip decision) is decided from the
# gradients and comes before the clip, which sees them unscaled.
# "build" (every rank built the same model) comes first: nothing later can agree without it.
# "build", "ownership", "precision" and "rng" findings come from checks (verify/checks/), not record pairs.
# "modules", "module_grads", "ops" and "op_inputs" are a zoom's only (verify/zoom/): each module's
# outputs in forward, its gradients in backward, the operations inside one module.
# "dims": a dimension package's own check of its arithmetic, from the reference alone (float8's
# matmuls against the rounding of their casts: verify/dims/float8/rounding.py), after the
# compiler's, as not the sharding's.
# "comm" and "memory" (the resource contracts) come last: a wrong number explains more than the
# traffic or the bytes it took.
PHASES = (
    "build",
    "ownership",
    "precision",
    "init",
    "buffers",
    "rng",
    "modules",
    "logits",
    "loss",
    "module_grads",
    "ops",
    "op_inputs",
    "grads",
    "loss_scale",
    "grad_norm",
    "params",
    "param_sums",
    "optim_state",
    "resumed",
    "comm",
    "memory",
    "compile",
    "compiler",
    "dims",
)
PHASE_RANK = {p: i for i, p in enumerate(PHASES)}

Key = tuple[int, str, str]
ALIGN = 64  # byte alignment of each record in a packed buffer (and in an arena, verify/sharded/arena.py)


def packed_entry(key: Key, t: torch.Tensor, offset: int) -> list[Any]:
    """A record's line in a packed header: its key, dtype, shape, offset and size in bytes."""
    step, phase, name = key
    return [step, phase, name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, t.numel() * t.element_size()]


# A step's generator fingerprints (verify/probes/rng.py), in the order they are taken.
_RNG_POINTS = {"before_forward": 0, "after_forward": 1, "after_backward": 2}


def sort_key(key: Key) -> tuple[int, int, str]:
    """Step, then phase in PHASES order, then name; a step's generator fingerprints in the order
    they are taken (micro-batch by micro-batch), so that the first divergence is the first in time."""
    step, phase, name = key
    if phase == "rng":
        point, _, microbatch = name.partition(".")
        if point in _RNG_POINTS and microbatch.isdigit():
            name = f"{int(microbatch):09d}.{_RNG_POINTS[point]}"
    return (step, PHASE_RANK[phase], name)


@dataclass
class Trace:
    side: str  # "reference" or "sharded"
    records: dict[Key, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, step: int, phase: str, name: str, value: torch.Tensor) -> None:
        if phase not in PHASE_RANK:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        self.records[(step, phase, name)] = value.detach().clone().contiguous().cpu()

    def keys_sorted(self) -> list[Key]:
        return sorted(self.records, key=sort_key)

    @property
    def steps(self) -> int:
        return max((k[0] for k in self.records), default=0)

    @property
    def first_step(self) -> int:
        """The first step this run trained (its first loss record): 1, or k + 1 for a run resumed
        after step k, whose steps before are the saving run's; 1 for a trace without one."""
        return min((k[0] for k in self.records if k[1] == "loss"), default=1)

    # ---- serialisation (no pickle) ------------------------------------------------------------
    def to_bytes(self) -> bytes:
        tensors = {f"{s}/{p}/{n}": t for (s, p, n), t in self.records.items()}
        header = {"side": self.side, "meta": json.dumps(self.meta, sort_keys=True)}
        return st_save(tensors, metadata=header)

    @classmethod
    def from_bytes(cls, blob: bytes) -> Trace:
        tensors = st_load(blob)
        header = _safetensors_metadata(blob)
        records: dict[Key, torch.Tensor] = {}
        for key, t in tensors.items():
            step, phase, name = key.split("/", 2)
            records[(int(step), phase, name)] = t
        return cls(side=header.get("side", "?"), records=records, meta=json.loads(header.get("meta", "{}")))

    # ---- between processes: one header and one byte buffer, no pickle, no per-tensor copies ----
    def pack(self) -> tuple[dict[str, Any], torch.Tensor]:
        """A JSON-able header and every record's bytes in one uint8 tensor (one copy), each at a
        64-byte aligned offset: what a rank sends the pool over its pipe (verify/sharded/worker.py).
        `unpack` gives back bit-identical records."""
        entries, parts, offset = [], [], 0
        for (step, phase, name), t in self.records.items():
            t = t.detach().contiguous().cpu()
            nbytes = t.numel() * t.element_size()
            pad = -offset % ALIGN
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8))
                offset += pad
            if nbytes:
                parts.append(t.reshape(-1).view(torch.uint8))
            entries.append(packed_entry((step, phase, name), t, offset))
            offset += nbytes
        buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        return {"side": self.side, "meta": self.meta, "records": entries, "nbytes": offset}, buf

    @classmethod
    def unpack(cls, header: dict[str, Any], buf: bytearray | torch.Tensor) -> Trace:
        """The Trace `pack` made, from its bytes or its uint8 tensor; records are views into
        `buf` (kept alive by them)."""
        records: dict[Key, torch.Tensor] = {}
        for step, phase, name, dtype, shape, offset, nbytes in header["records"]:
            dt = getattr(torch, dtype)
            if nbytes:
                if isinstance(buf, torch.Tensor):
                    raw = buf[offset : offset + nbytes]
                else:
                    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
                records[(step, phase, name)] = raw.view(dt).reshape(shape)
            else:
                records[(step, phase, name)] = torch.empty(shape, dtype=dt)
        return cls(side=header["side"], records=records, meta=header["meta"])

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.to_bytes())
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_bytes(Path(path).read_bytes())


def _safetensors_metadata(blob: bytes) -> dict[str, str]:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n].decode()).get("__metadata__", {})
