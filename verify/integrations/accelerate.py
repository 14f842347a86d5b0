"""The Recorder around a loop that Accelerate runs (`accelerator.prepare`). Tested with
accelerate 1.15.0 and torch 2.13 (docs/accelerate.md).

    rec = recorder(accelerator, model, optimizer, out="runs/sharded")   # after accelerator.prepare
    for batch in loader:
        outputs = model(**batch); accelerator.backward(outputs.loss); optimizer.step(); optimizer.zero_grad()
        rec.step(loss=outputs.loss, logits=outputs.logits, batch=batch)
    rec.close()

What it adds to `Recorder(model, optimizer, out)`: the hooks go on the optimizer Accelerate
wraps (an `AcceleratedOptimizer` steps it only on a step that syncs, so accumulation needs
nothing more), and the run is recorded as meant to shard when Accelerate was asked for FSDP (an
`fsdp_plugin`, or `accelerate launch` with an FSDP config: both set ACCELERATE_USE_FSDP), as replicated on
purpose when Accelerate runs DistributedDataParallel without being asked for FSDP. On a
CPU-only machine Accelerate 1.15 does not shard and says nothing: with `cpu=True` it wraps the model
in DistributedDataParallel, without it each process trains its own copy. `compare` then says
NOT SHARDED.
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_verify.integrations import require
from fsdp_verify.recorder import Recorder

ASKED = "ACCELERATE_USE_FSDP"


def fsdp_asked() -> bool:
    return os.environ.get(ASKED, "false").lower() == "true"


def recorder(accelerator, model, optimizer, out: str | Path, **options) -> Recorder:
    """A Recorder for the prepared `model` and `optimizer` (options as Recorder's)."""
    require("accelerate", "accelerate")
    if fsdp_asked():
        options.setdefault("sharded", True)
        options.setdefault("sharded_by", f"{ASKED}=true: an fsdp_plugin, or accelerate launch with an FSDP config")
    elif str(accelerator.distributed_type).split(".")[-1].startswith("MULTI_"):
        options.setdefault("sharded", False)  # Accelerate's DistributedDataParallel, asked for
        options.setdefault("sharded_by", "Accelerate without FSDP: its DistributedDataParallel")
    return Recorder(accelerator.unwrap_model(model), getattr(optimizer, "optimizer", optimizer), out, **options)
