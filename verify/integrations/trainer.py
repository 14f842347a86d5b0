"""The Recorder as a transformers `TrainerCallback`. Tested with transformers 5.24.0 (and accelerate
1.15.0, which its Trainer runs on), torch 2.13 (docs/hf-trainer.md).

    trainer = Trainer(model=model, args=args, train_dataset=data)
    RecorderCallback(trainer, out="runs/ref")    # out="runs/sharded" under torchrun
    trainer.train()

Each micro-batch the Trainer trains on is a step of the run (`Recorder.step`): its batch (the
inputs the Trainer passed, hashed before `compute_loss` can pop the labels), its logits (the
model's output, by a forward hook) and its loss as `training_step` returns it: what the Trainer
backpropagates and logs, after its own scaling (divided for gradient accumulation, multiplied by
the number of processes when it averages tokens across them), so the ranks' mean is the
single-process run's loss. The callback needs the trainer for that loss: callbacks are not given
it. Gradients, parameters and optimizer state are caught on the optimizer Accelerate wraps, as
the Recorder does (after the Trainer's gradient clipping, before the update).

The run is recorded as meant to shard when TrainingArguments ask for FSDP (`fsdp`): on a CPU-only
machine the Trainer (through Accelerate 1.15) then trains under DistributedDataParallel without a
word, and `compare` says NOT SHARDED. Without `fsdp`, a run the Trainer wraps in DDP is recorded
as replicated on purpose, and a model sharded before the Trainer got it as the Recorder decides
(meant to shard on more than one rank).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fsdp_verify.integrations import require
from fsdp_verify.recorder import Recorder

_transformers = require("transformers", "hf")


class RecorderCallback(_transformers.TrainerCallback):
    """Records `trainer`'s training run into `out` (each rank out/rank{r}/); `options` as
    Recorder's (full_steps, full_params, modules, sharded, ...). Adds itself to the trainer."""

    def __init__(self, trainer, out: str | Path, **options):
        self.trainer, self.out, self.options = trainer, out, options
        self.recorder: Recorder | None = None
        self._loss = self._logits = self._batch = None
        self._hook = None
        train_one = trainer.training_step

        def training_step(model, inputs, *args, **kwargs):
            self._batch = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            self._loss = train_one(model, inputs, *args, **kwargs)
            return self._loss

        trainer.training_step = training_step
        trainer.add_callback(self)

    def _keep_logits(self, _module, _args, output) -> None:
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, dict):
            logits = output.get("logits")
        self._logits = logits

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        options = dict(self.options)
        if args.fsdp:
            options.setdefault("sharded", True)
            options.setdefault("sharded_by", f"TrainingArguments.fsdp={args.fsdp!r}")
        elif str(self.trainer.accelerator.distributed_type).split(".")[-1].startswith("MULTI_"):
            options.setdefault("sharded", False)  # the Trainer's own DistributedDataParallel, asked for
            options.setdefault("sharded_by", "TrainingArguments without fsdp: the Trainer's DistributedDataParallel")
        self.recorder = Recorder(model, getattr(optimizer, "optimizer", optimizer), self.out, **options)
        self._hook = model.register_forward_hook(self._keep_logits)

    def _record(self) -> None:
        if self.recorder is not None:
            self.recorder.step(loss=self._loss, logits=self._logits, batch=self._batch)
            self._loss = self._logits = self._batch = None

    def on_substep_end(self, args, state, control, **kwargs):  # a micro-batch that did not step
        self._record()

    def on_step_end(self, args, state, control, **kwargs):  # after the optimizer step
        self._record()

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
