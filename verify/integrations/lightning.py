"""The Recorder as a Lightning `Callback`. Tested with lightning 2.6.6, torch 2.13
(docs/lightning.md).

    trainer = L.Trainer(..., callbacks=[RecorderCallback(out="runs/ref")])

Each training batch is a step of the run: its batch, the loss `training_step` returned (as
Lightning reports it: divided by `accumulate_grad_batches`) and, where `training_step` returns a
dict with "logits", its logits. Lightning steps the optimizer with a closure that runs forward and
backward inside `optimizer.step`, so the gradients are recorded in `on_before_optimizer_step`
(after backward, before Lightning's gradient clipping), not in the optimizer's pre-step hook.

The run is recorded as meant to shard under `FSDPStrategy` or `ModelParallelStrategy` (FSDP2 in
`configure_model`), and as replicated on purpose under `DDPStrategy`; `compare` says NOT SHARDED
when a strategy meant to shard left parameters plain on every rank (a `configure_model` that never
calls `fully_shard`), or ranks drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fsdp_verify.integrations import require
from fsdp_verify.recorder import Recorder

_pl = require("lightning.pytorch", "lightning")
SHARDING = ("FSDPStrategy", "ModelParallelStrategy")
REPLICATING = ("DDPStrategy",)


class RecorderCallback(_pl.Callback):
    """Records the fit's training run into `out` (each rank out/rank{r}/); `options` as
    Recorder's (full_steps, full_params, modules, sharded, ...)."""

    def __init__(self, out: str | Path, **options):
        self.out, self.options = out, options
        self.recorder: Recorder | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"optimizers: expected one optimizer, got {len(trainer.optimizers)}")
        options = dict(self.options)
        strategy = type(trainer.strategy).__name__
        if strategy in SHARDING + REPLICATING:
            options.setdefault("sharded", strategy in SHARDING)
            options.setdefault("sharded_by", f"Trainer(strategy={strategy})")
        self.recorder = Recorder(pl_module, trainer.optimizers[0], self.out, closure_step=True, **options)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.recorder is not None:
            self.recorder.before_optimizer_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.recorder is None:
            return
        out = outputs if isinstance(outputs, Mapping) else {"loss": outputs}
        self.recorder.step(loss=out.get("loss"), logits=out.get("logits"), batch=batch)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
