"""What recording costs where users already train: the transformers Trainer with and without
RecorderCallback, Lightning with and without its RecorderCallback, an Accelerate loop with and
without its recorder, as ratios to the plain run
(the way bench/recorder_overhead.py measures the Recorder: rounds interleaved after a warm-up
round, the median of each, so load from other jobs falls on both alike).

Trainer: a Llama from fsdp_verify.models.hf.tiny_llama widened to bench/recorder_overhead.py's
medium size (width 128, 4 layers, vocab 512, sequences of 64, batch 8), AdamW, `trainer.train()`
timed (its setup inside train() included: the recorder's initial fingerprints are taken there).
Lightning: recorder_overhead.py's medium built-in Transformer, Adam, `trainer.fit()` timed.
Accelerate: the same model and data in a loop under Accelerator(cpu=True), the recorder built
inside the timed part (its initial fingerprints counted), `close()` too.
One process, one thread; the fingerprints only (no tensor stored whole).

    python bench/integration_overhead.py [--steps 20] [--repeats 5] [--only trainer|lightning|accelerate] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MEDIUM = dict(vocab_size=512, dim=128, n_layers=4, n_heads=4, ffn_hidden=344, seq_len=64)
BATCH = 8


def tokens(steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, MEDIUM["vocab_size"], (steps * BATCH, MEDIUM["seq_len"]), generator=g)


def trainer_run(record: bool, steps: int, out: str) -> float:
    from transformers import Trainer, TrainingArguments

    from fsdp_verify.integrations.trainer import RecorderCallback
    from fsdp_verify.models.hf import tiny_llama

    ids = tokens(steps)
    data = [{"input_ids": row, "labels": row} for row in ids]
    torch.manual_seed(0)
    model = tiny_llama(
        vocab_size=MEDIUM["vocab_size"],
        hidden_size=MEDIUM["dim"],
        intermediate_size=MEDIUM["ffn_hidden"],
        num_hidden_layers=MEDIUM["n_layers"],
        num_attention_heads=MEDIUM["n_heads"],
        num_key_value_heads=MEDIUM["n_heads"],
        max_position_embeddings=MEDIUM["seq_len"],
    )
    args = TrainingArguments(
        output_dir=out + "-trainer",
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    if record:
        RecorderCallback(trainer, out=out)
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start


def lightning_run(record: bool, steps: int, out: str) -> float:
    import lightning as L
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from fsdp_verify.integrations.lightning import RecorderCallback
    from fsdp_verify.models import ModelSpec, build_model

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(ModelSpec(kind="transformer", **MEDIUM), seed=0)

        def training_step(self, batch, _):
            logits = self.model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            return {"loss": loss, "logits": logits.detach()}

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, MEDIUM["vocab_size"], (steps * BATCH, MEDIUM["seq_len"] + 1), generator=g)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[RecorderCallback(out=out)] if record else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Lit()
    start = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return time.perf_counter() - start


def accelerate_run(record: bool, steps: int, out: str) -> float:
    import torch.nn.functional as F
    from accelerate import Accelerator

    from fsdp_verify.integrations.accelerate import recorder
    from fsdp_verify.models import ModelSpec, build_model

    accelerator = Accelerator(cpu=True)
    model = build_model(ModelSpec(kind="transformer", **MEDIUM), seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, MEDIUM["vocab_size"], (steps * BATCH, MEDIUM["seq_len"] + 1), generator=g)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    start = time.perf_counter()
    rec = recorder(accelerator, model, optimizer, out=out) if record else None
    for batch in loader:
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if rec:
            rec.step(loss=loss, logits=logits, batch=batch)
    if rec:
        rec.close()
    return time.perf_counter() - start


RUNS = {"trainer": trainer_run, "lightning": lightning_run, "accelerate": accelerate_run}


class Inside:
    """Time spent inside the Recorder (its construction, hooks and step) however an integration
    built it: a second measure of the cost that load from other jobs moves less than wall time."""

    seconds = 0.0
    METHODS = ("__init__", "before_optimizer_step", "_after_optimizer", "step", "close")

    @classmethod
    def install(cls) -> None:
        from fsdp_verify.recorder.recorder import Recorder

        for name in cls.METHODS:
            original = getattr(Recorder, name)

            def timed(*args, _original=original, **kwargs):
                t = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    cls.seconds += time.perf_counter() - t

            setattr(Recorder, name, timed)


def measure(which: str, steps: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"bare": [], "recorded": []}
    inside: list[float] = []
    with tempfile.TemporaryDirectory(prefix="fsdp-verify-integration-") as tmp:
        for i in range(repeats + 1):
            for mode in times:
                Inside.seconds = 0.0
                t = RUNS[which](mode == "recorded", steps, os.path.join(tmp, f"{which}-{mode}-{i}"))
                if i > 0:  # the first round warms up
                    times[mode].append(t)
                    if mode == "recorded":
                        inside.append(Inside.seconds)
    med = {m: statistics.median(v) for m, v in times.items()}
    return {
        "bare_s": med["bare"],
        "recorded_s": med["recorded"],
        "ratio": med["recorded"] / med["bare"],
        # the same rounds: each recorded run's time inside the Recorder over the plain run of its round
        "inside_ratio": 1 + statistics.median(t / b for t, b in zip(inside, times["bare"])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", choices=sorted(RUNS))
    p.add_argument("--json", type=str)
    args = p.parse_args()
    Inside.install()
    results = {w: measure(w, args.steps, args.repeats) for w in ([args.only] if args.only else sorted(RUNS))}
    print(f"medium size {MEDIUM}, batch {BATCH}, {args.steps} steps, one process, median of {args.repeats}")
    print("ratio: wall time over the plain run's; 1 + inside: 1 + the time inside the Recorder over the plain run")
    print(f"{'integration':12s} {'plain s':>8s} {'recorded s':>11s} {'ratio':>7s} {'1+inside':>9s}")
    for w, r in results.items():
        print(f"{w:12s} {r['bare_s']:8.3f} {r['recorded_s']:11.3f} {r['ratio']:7.3f} {r['inside_ratio']:9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
