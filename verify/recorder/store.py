"""A recorded run on disk: `OUT/rank{r}/meta.json` (environment and settings) and one
`OUT/rank{r}/step{NNNNNN}.safetensors` per `Recorder.step` call (step 0: the initial state), its
JSON header naming what each tensor is. Safetensors and JSON only, never pickle: a run from a
colleague's cluster is data, and opening it cannot execute code. Each rank writes its own files,
so recording needs no collective and no rank ever holds the whole model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

SCHEMA_VERSION = 1
RUN_KIND = "fsdp-verify recorder run"


class RunError(ValueError):
    """A run directory that cannot be read: the message names the path and the field."""


def rank_dir(out: str | Path, rank: int) -> Path:
    return Path(out) / f"rank{rank}"


def write_meta(out: str | Path, rank: int, meta: dict[str, Any]) -> None:
    d = rank_dir(out, rank)
    d.mkdir(parents=True, exist_ok=True)
    (d / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def write_step(out: str | Path, rank: int, call: int, tensors: dict[str, torch.Tensor], header: dict) -> Path:
    return _write(rank_dir(out, rank) / f"step{call:06d}.safetensors", tensors, header)


def write_state(out: str | Path, rank: int, when: str, tensors: dict[str, torch.Tensor], header: dict) -> Path:
    """The state at one moment (`when`: "at_load", "at_close"), laid out as a step's file."""
    return _write(rank_dir(out, rank) / f"{when}.safetensors", tensors, header)


def _write(path: Path, tensors: dict[str, torch.Tensor], header: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Serialised in memory, then one write: half the time of save_file on this step's few small tensors.
    path.write_bytes(save({k: v.contiguous() for k, v in tensors.items()}, metadata={"header": json.dumps(header)}))
    return path


class Run:
    """A run read back: per rank its meta and step files, opened lazily."""

    def __init__(self, path: str | Path, label: str):
        self.path, self.label = Path(path), label
        if not self.path.is_dir():
            raise RunError(f"{label}: {path}: no such directory")
        ranks = sorted(self.path.glob("rank*/meta.json"))
        if not ranks:
            raise RunError(f"{label}: {path}: no rank*/meta.json (not a run written by fsdp_verify.recorder.Recorder)")
        self.meta = [self._meta(p) for p in ranks]
        world = self.meta[0]["world_size"]
        got = sorted(m["rank"] for m in self.meta)
        if got != list(range(world)):
            raise RunError(f"{label}: {path}: world_size is {world} but the ranks recorded are {got}")
        self.meta.sort(key=lambda m: m["rank"])
        self.world_size = world
        self.calls = [
            sorted(int(p.stem[4:]) for p in rank_dir(path, r).glob("step*.safetensors")) for r in range(world)
        ]
        if any(c != self.calls[0] for c in self.calls):
            raise RunError(f"{label}: {path}: ranks recorded different steps: {dict(enumerate(self.calls))}")
        # A run that resumed from a checkpoint (`Recorder(resumed_from=...)`): read as one run with
        # the run before it, each step from the part (and world size) that ran it.
        self.before: Run | None = None
        self.resumed_after: int | None = self.meta[0].get("resumed_after")
        if self.meta[0].get("resumed_from") is not None:
            self.before = Run(self.meta[0]["resumed_from"], f"{label} (before its resume)")
            if self.before.calls[0][-1:] != [self.resumed_after]:
                raise RunError(
                    f"{label}: {path}: resumed_after: {self.resumed_after}, but the run before it"
                    f" ({self.before.path}) recorded steps up to {self.before.calls[0][-1:]}"
                )
            if self.before.param_names != self.param_names:
                raise RunError(f"{label}: {path}: params: not those of the run it resumed from ({self.before.path})")
            self.calls = [self.before.calls[0] + c for c in self.calls]

    def world_at(self, call: int) -> int:
        """The world size of the part of the run that recorded step `call`."""
        if self.before is not None and call <= self.resumed_after:
            return self.before.world_at(call)
        return self.world_size

    def _meta(self, p: Path) -> dict[str, Any]:
        try:
            meta = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise RunError(f"{self.label}: {p}: not valid JSON: {e}") from None
        for field in ("schema_version", "rank", "world_size", "params"):
            if field not in meta:
                raise RunError(f"{self.label}: {p}: {field}: missing")
        if meta["schema_version"] != SCHEMA_VERSION:
            raise RunError(
                f"{self.label}: {p}: schema_version: expected {SCHEMA_VERSION}, got {meta['schema_version']!r}"
            )
        return meta

    @property
    def param_names(self) -> list[str]:
        return [p[0] for p in self.meta[0]["params"]]

    def load(self, rank: int, call: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if self.before is not None and call <= self.resumed_after:
            return self.before.load(rank, call)
        return self._read(rank_dir(self.path, rank) / f"step{call:06d}.safetensors")

    def load_state(self, when: str) -> list[tuple[dict[str, torch.Tensor], dict[str, Any]]] | None:
        """Every rank's state "at_load" (a resumed run's, right after its load) or "at_close" (the
        state it ended with); None for a run that did not record it (a recorder before it did)."""
        paths = [rank_dir(self.path, r) / f"{when}.safetensors" for r in range(self.world_size)]
        if not all(p.is_file() for p in paths):
            return None
        return [self._read(p) for p in paths]

    @staticmethod
    def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        try:
            with safe_open(str(path), framework="pt") as f:
                header = json.loads((f.metadata() or {}).get("header", "{}"))
                return {k: f.get_tensor(k) for k in f.keys()}, header  # noqa: SIM118 (safe_open is not iterable)
        except (SafetensorError, json.JSONDecodeError) as e:  # a truncated or foreign file: name it
            raise RunError(f"{path}: not a step the recorder wrote ({type(e).__name__}: {e})") from e
