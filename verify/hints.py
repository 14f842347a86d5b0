"""Turn a first divergence into a likely cause, from the shape of the difference."""

from __future__ import annotations

import torch

from fsdp_verify.compare.finding import Finding
from fsdp_verify.trace import Trace

# Precision-contract findings are named "<stage>:<name>" (verify/checks/precision.py).
_PRECISION_HINTS = {
    "sharded": (
        "the sharded parameters (the master weights) are held in {got}, not fp32: the model was cast"
        " (model.to({got})) before sharding, or the engine shards low-precision copies. Keep master"
        " weights, gradients and optimizer state fp32 and let param_dtype cast the unsharded copies"
        " (seed 000)"
    ),
    "reduce": (
        "gradients are reduced in {got}, not the policy's reduce_dtype: the reduce_dtype never reached"
        " the engine, or it casts before the collective (seed 000: bf16 reductions lose small contributions)"
    ),
    "forward_params": (
        "forward ran with {got} parameters, not param_dtype: the MixedPrecisionPolicy never reached"
        " the engine's all-gather (seed 000)"
    ),
    "backward_grads": "backward computed gradients in {got}, not param_dtype: the policy is not applied in backward",
    "grads": "the reduced gradients are held in {got}, not fp32: they must be cast back to the master weights' dtype",
    "optim_state": "the optimizer state is held in {got}, not fp32: the optimizer was built on low-precision parameters",
    "outputs": "unit outputs are {got}, not the policy's output_dtype",
    "forward_inputs": "unit inputs reached the forward in {got}, not param_dtype: cast_forward_inputs was not applied",
}


def precision_hint(first: Finding, got: Trace) -> str:
    """The hint for a broken precision contract, naming the dtype the probe saw."""
    stage, _, name = first.name.partition(":")
    steps = got.meta.get("precision", {}).get("steps", {})
    seen = steps.get(str(first.step), {}).get(stage, {}).get(name, [])
    template = _PRECISION_HINTS.get(stage)
    return template.format(got=" and ".join(seen) or "another dtype") if template else ""


def resume_hint(first: Finding, ref: Trace, got: Trace) -> str:
    """What a resume lost, named by the first record of the loaded state that is not the saved
    one (verify/training/resume.py lists what a checkpoint carries)."""
    name = first.name
    where = f"right after the resume's load (after step {first.step})"
    values = ""
    if first.kind == "deviation" and first.key in ref.records and ref.records[first.key].numel() <= 4:
        values = f": {got.records[first.key].tolist()}, saved {ref.records[first.key].tolist()}"
    if name == "data_position":
        return f"the data position is not the saved one {where}{values}: the data restarted, batches are seen twice"
    if name.startswith("loss_scale."):
        return f"the loss scaler's {name.split('.', 1)[1]} is not the saved one {where}{values}: the scaler was reset"
    if name == "rng":
        return f"the ranks' generators are not the saved ones {where}: the RNG state was not restored (dropout masks)"
    if name.startswith("schedule."):
        return (
            f"the lr schedule's position ({name.removeprefix('schedule.')}) is not the saved one {where}{values}:"
            " the scheduler was not restored (a fresh one restarts the schedule)"
        )
    if name == "lr":
        return f"the learning rate is not the saved one {where}{values}: the lr schedule was not restored"
    if name.startswith("optim.") and name.endswith(".step"):
        return f"Adam's step count is not the saved one {where}{values}: reset on resume, its bias correction restarts"
    if name.startswith("optim."):
        return (
            f"the optimizer state ({name.removeprefix('optim.')}) is not the saved one {where}: a fresh optimizer"
            " after resume, its state never loaded"
        )
    if name.startswith("params."):
        return (
            f"parameter {name.removeprefix('params.')} is not the saved one {where}: its key was not loaded"
            " (renamed, e.g. by a wrapper's prefix, and dropped by a non-strict load?)"
        )
    return ""


def hint(first: Finding | None, ref: Trace, got: Trace, world_size: int, init: str = "eager") -> str:
    if first is not None and first.phase == "precision" and first.kind == "contract":
        return precision_hint(first, got)
    if first is not None and first.phase == "build" and first.comparator == "ModelBuildCheck":
        return "build the model from the seed alone: every rank and the reference must construct the same model"
    if first is not None and first.phase == "resumed":
        return resume_hint(first, ref, got)
    if first is None or first.kind != "deviation":
        return ""
    if first.phase == "loss":
        return loss_hint(first, got)
    a, b = ref.records[first.key].double().flatten(), got.records[first.key].double().flatten()
    if first.phase == "init" and init == "meta":
        return (
            "initial parameters differ from an eager build: the meta-device build or its materialisation"
            " consumed or reordered random numbers (save and restore the RNG state; seed 004)"
        )
    if first.phase == "init":
        return "initial parameters differ: ranks initialised differently, or a shard holds the wrong slice"
    if first.phase == "param_sums" and first.name == "__total__":
        ratio = (b.sum() / a.sum()).item() if a.sum().item() != 0 else float("nan")
        return f"the parameter total is {ratio:.3g}x the reference's: a parameter may be held twice or missed"
    denom = a.dot(a).item()
    if denom == 0:
        return ""
    scale = a.dot(b).item() / denom
    fits = (b - scale * a).norm().item() <= 1e-3 * a.norm().item()
    if fits and first.phase == "grads":
        if abs(scale) < 1e-6:
            return "the gradient is zero: was it reduced at all (gradient sync off)?"
        for name, value in (("1/world_size", 1 / world_size), ("world_size", world_size)):
            if world_size > 1 and abs(scale - value) <= 1e-3 * value:
                return f"the gradient is {name} x the reference's: divided by the world size {'once too often' if value < 1 else 'too rarely'}"
    if fits and abs(scale - 1) > 1e-3:
        return f"the sharded values are {scale:.4g}x the reference's"
    if first.phase == "logits" and first.max_rel > 0 and torch.is_tensor(b):
        rows = ref.records[first.key].shape[0]
        per = rows // max(world_size, 1)
        diff = (ref.records[first.key] - got.records[first.key]).double().abs().flatten(1).amax(1) if rows else None
        if diff is not None and per > 0:
            bad = sorted({i // per for i in torch.nonzero(diff > 0).flatten().tolist()})
            if 0 < len(bad) < world_size:
                return f"only the samples of rank(s) {bad} differ"
    return ""


def loss_hint(first: Finding, got: Trace) -> str:
    """The loss is the first record to part, so the logits it is computed from agreed: the loss
    itself is computed or normalised differently. With different numbers of real tokens per
    micro-batch or rank (padded batches), a per-micro-batch or per-rank mean is the usual cause."""
    counts = got.meta.get("items", {}).get(str(first.step))
    flat = [n for rank in counts or [] for n in rank]
    if len(set(flat)) > 1:
        return (
            "the loss differs although the logits agree: loss normalisation. Micro-batches and ranks hold"
            f" different numbers of real tokens ({counts}, per rank and micro-batch); scale each micro-batch's"
            " loss sum by dp_size / global_batch_tokens (seed 000), not by its own or its rank's token count"
        )
    return "the loss differs although the logits agree: the loss is computed or normalised differently"
