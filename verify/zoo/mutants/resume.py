"""A checkpoint's resume (verify/training/resume.py; docs/resume.md): each mutant is the FSDP2
engine whose checkpoints load through a Checkpointer with one step of the load changed, each
caught right after the load. The save and the training are FSDP2's own. Those beside tp, ep and
pp sit with their parallelism."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from fsdp_verify.training.resume import Checkpointer, trainer_template
from fsdp_verify.zoo.mutants._shared import _local, _resuming
from fsdp_verify.zoo.pins import RESUME
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)


class _FreshOptimizer(Checkpointer):
    """Loads the model only: the optimizer after resume is a fresh one (its moments zero), the
    common slip of a resume that restores `model.load_state_dict` and builds a new optimizer."""

    def load(self, path, optimizer):
        model_sd = get_model_state_dict(self.module)
        trainer = trainer_template(path)
        state = {"model": model_sd, "trainer": trainer}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.module, state["model"])
        return trainer


fresh_optimizer_after_resume = bug(
    "resumes with the model loaded and a fresh optimizer (Adam's moments zero)",
    "a resume that restores model.load_state_dict only (issue 29)",
    ("resumed",),
    pins={**RESUME, "optim.name": st.sampled_from(("adam", "adamw"))},
    name="fresh_optimizer_after_resume",
)(_resuming(_FreshOptimizer))


class _AdamStepReset(Checkpointer):
    """Loads everything, then resets Adam's step count to 0 (a resume that re-creates the
    per-parameter `step` or loads a checkpoint written before it was saved): the bias
    correction restarts and the first updates after the resume are too large."""

    def after_load(self, optimizer, trainer):
        for state in optimizer.state.values():
            if "step" in state:
                state["step"] = torch.zeros_like(state["step"])
        return trainer


adam_step_reset_on_resume = bug(
    "resumes with Adam's step count reset to 0: its bias correction restarts",
    "a per-parameter `step` re-created on resume (issue 29)",
    ("resumed",),
    pins={**RESUME, "optim.name": st.sampled_from(("adam", "adamw"))},
    name="adam_step_reset_on_resume",
)(_resuming(_AdamStepReset))


class _PrefixDroppedByNonStrictLoad(Checkpointer):
    """The loading side names a parameter with a wrapper's prefix (`_orig_mod.`, as torch.compile
    does), the checkpoint without it; the load is non-strict (`allow_partial_load`, `strict=False`),
    so that parameter keeps its fresh initial values and nobody is told."""

    def rename(self, model_sd):
        first = next(iter(model_sd))
        return {(f"_orig_mod.{k}" if k == first else k): v for k, v in model_sd.items()}

    def planner(self):
        return DefaultLoadPlanner(allow_partial_load=True)

    def set(self, optimizer, model_sd, optim_sd, strict=True):
        super().set(optimizer, model_sd, optim_sd, strict=False)


prefixed_key_dropped_on_resume = bug(
    "a parameter named with a wrapper's prefix (`_orig_mod.`) on the loading side, dropped by a"
    " non-strict load: it keeps its initial values",
    "strict=False / allow_partial_load hiding a renamed key (issue 29)",
    ("resumed",),
    pins={**RESUME, "model.frozen": ()},
    name="prefixed_key_dropped_on_resume",
)(_resuming(_PrefixDroppedByNonStrictLoad))


class _RngNotRestored(Checkpointer):
    """Loads model, optimizer and the trainer's counters, but not the generators: each rank's
    dropout masks after the resume are those of a fresh seed, not the stream it was on."""

    def after_load(self, optimizer, trainer):
        return {k: v for k, v in trainer.items() if k != "rng"}


rng_not_restored_on_resume = bug(
    "resumes without the ranks' generators: dropout masks from a fresh seed",
    "RNG state left out of the checkpoint (issue 29)",
    ("resumed",),
    pins={**RESUME, "model.dropout": 0.1},
    name="rng_not_restored_on_resume",
)(_resuming(_RngNotRestored))


class _LossScaleReset(Checkpointer):
    """Loads everything but the loss scaler's state: the scale restarts at `init_scale` and the
    good-step count at 0 (a `GradScaler` built anew on resume)."""

    def after_load(self, optimizer, trainer):
        return {k: v for k, v in trainer.items() if not k.startswith("loss_scale.")}


loss_scale_reset_on_resume = bug(
    "resumes with a new GradScaler: the scale back at init_scale",
    "the scaler's state_dict left out of the checkpoint (issue 29)",
    ("resumed",),
    precisions=("fp16",),
    pins={**RESUME, "loss_scaling.growth_interval": 1},
    name="loss_scale_reset_on_resume",
)(_resuming(_LossScaleReset))


class _DataPositionReset(Checkpointer):
    """Loads everything but the data loader's position: the resumed run starts the data from
    the beginning, so its first batch is one the run saw already (step 1's)."""

    def after_load(self, optimizer, trainer):
        return {**trainer, "data_position": torch.zeros_like(trainer["data_position"])}


data_position_reset_on_resume = bug(
    "resumes with the data from the beginning: step 1's batch seen twice",
    "a data loader's position not restored (issue 29)",
    ("resumed",),
    pins=dict(RESUME),
    name="data_position_reset_on_resume",
)(_resuming(_DataPositionReset))


class _SchedulerNotRestored(Checkpointer):
    """Loads everything but the learning-rate schedule's position: the resumed scheduler is a
    fresh one at step 0 (the loop saved `optimizer.state_dict()` but not
    `scheduler.state_dict()`). The loaded lr is right; the next ones are the schedule's from
    the start (LinearLR's warmup restarts)."""

    def after_load(self, optimizer, trainer):
        return {k: v for k, v in trainer.items() if not k.startswith("schedule.")}


scheduler_not_restored_on_resume = bug(
    "resumes with a fresh lr scheduler: the schedule restarts from step 0",
    "scheduler.state_dict() left out of the checkpoint (issue 29)",
    ("resumed",),
    pins={**RESUME, "optim.schedule": st.sampled_from(("exponential", "linear_warmup"))},
    name="scheduler_not_restored_on_resume",
)(_resuming(_SchedulerNotRestored))


# ---- slips of a loop's load that a user brought (issue 38) -----------------------------------------
# Each named right after the load, by a hint that tests its cause against the records (verify/hints.py).
class _OptimStateSwapped(Checkpointer):
    """Loads everything, but the optimizer state of two parameters of the same shape lands on
    each other: a state dict keyed by position (`optimizer.state_dict()`'s integer ids) loaded
    into an optimizer whose parameters are listed in another order (built from a dict of
    parameter groups, or after a refactor moved a layer). Same shapes, so nothing complains."""

    def after_load(self, optimizer, trainer):
        seen: dict[tuple[int, ...], nn.Parameter] = {}
        for _, p in self.module.named_parameters():
            if not optimizer.state.get(p):
                continue
            other = seen.setdefault(tuple(p.shape), p)
            if other is not p:
                optimizer.state[p], optimizer.state[other] = optimizer.state[other], optimizer.state[p]
                break
        return trainer


optimizer_state_swapped_on_resume = bug(
    "the optimizer state of two parameters of the same shape lands on each other",
    "a state dict keyed by position loaded into an optimizer listing its parameters in another order (issue 38)",
    ("resumed",),
    # two layers of the same output width: their biases (and, square, their weights) alike
    pins={
        **RESUME,
        "optim.name": st.sampled_from(("adam", "adamw")),
        "model.widths": st.tuples(st.integers(1, 16), st.integers(2, 16)).map(lambda t: (t[0], t[1], t[1])),
        "model.frozen": (),
    },
    name="optimizer_state_swapped_on_resume",
)(_resuming(_OptimStateSwapped))


class _OptimStateInBf16(Checkpointer):
    """Loads everything, the optimizer's float state rounded through bf16 (a checkpoint that
    stored Adam's moments in bf16 to save space, read back into fp32 state)."""

    def after_load(self, optimizer, trainer):
        with torch.no_grad():
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        local = _local(value)
                        local.copy_(local.to(torch.bfloat16).to(local.dtype))
        return trainer


optimizer_state_in_bf16_on_resume = bug(
    "every float optimizer state rounded through bf16 by the load",
    "a checkpoint that stored the optimizer's moments in bf16 (issue 38)",
    ("resumed",),
    pins={**RESUME, "optim.name": st.sampled_from(("adam", "adamw"))},
    name="optimizer_state_in_bf16_on_resume",
)(_resuming(_OptimStateInBf16))


class _LoadedOnRank0Only(Checkpointer):
    """Loads the optimizer on every rank but the model's weights on rank 0 only: the other ranks
    keep the shards of the freshly built model (an `if rank == 0:` left over from a loop that
    loaded a full state dict on rank 0 and broadcast it, the broadcast since removed)."""

    def load(self, path, optimizer):
        fresh = [] if dist.get_rank() == 0 else [_local(p).detach().clone() for p in self.module.parameters()]
        trainer = super().load(path, optimizer)
        with torch.no_grad():
            for p, before in zip(self.module.parameters(), fresh):
                _local(p).copy_(before)
        return trainer


weights_loaded_on_rank0_only = bug(
    "only rank 0 takes the loaded weights; the other ranks keep the fresh model's shards",
    "an `if rank == 0` left from a full-state-dict load whose broadcast was removed (issue 38)",
    ("resumed",),
    pins=dict(RESUME),
    name="weights_loaded_on_rank0_only",
)(_resuming(_LoadedOnRank0Only))


class _WeightDecayFromTheCode(Checkpointer):
    """Loads everything, then applies the loop's own optimizer settings to the param groups
    (`for g in optimizer.param_groups: g.update(config)`), whose `weight_decay` is 0: the saved
    one is overwritten, and the run goes on without weight decay."""

    def after_load(self, optimizer, trainer):
        for group in optimizer.param_groups:
            group["weight_decay"] = 0.0
        return trainer


weight_decay_from_the_code_on_resume = bug(
    "the resumed optimizer's param groups take the code's weight_decay (0) over the saved one",
    "a loop that re-applies its optimizer config after the load (issue 38)",
    ("resumed",),
    pins={
        **RESUME,
        "optim.name": st.sampled_from(("adamw", "sgd")),
        "optim.weight_decay": st.sampled_from((0.01, 0.1)),
    },
    name="weight_decay_from_the_code_on_resume",
)(_resuming(_WeightDecayFromTheCode))
