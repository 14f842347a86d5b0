"""What the reference does not model beside each parallelism composed with FSDP, in one table:
Case's validation refuses it (naming the field, exit 2) and the draws turn it off (unless a pin
asked for it, which then draws the composition off instead). A composition added later (tp,
compile) adds its row here; a field refused beside two of them is listed under either. A row
naming another composition (pp's "ep") also keeps the draw from turning the other off
(`beside_another`).

Each row: the case's field that turns the composition on (on above `1`), and for every case
field the reference does not model beside it, its value when off and why."""

from __future__ import annotations

from typing import Any

from fsdp_verify.validation import check

WHAT = {"ep": "expert parallelism", "pp": "pipeline parallelism"}

NOT_BESIDE: dict[str, dict[str, tuple[Any, str]]] = {
    "ep": {
        "step": (None, "a user's step (its own collectives are not modelled)"),
        "shard_placement": ("dim0", "Shard(1) placements of the experts"),
        "clip_norm": (None, "a clip (the experts' norm over two meshes is not modelled yet)"),
        "offload": (False, "CPU offload of the experts"),
        "compile": (None, "torch.compile (routed experts: a graph per count of routed samples)"),
    },
    "pp": {
        "step": (None, "a user's step (the schedule runs forward and backward)"),
        "clip_norm": (None, "a clip (the norm over the stages is not modelled yet)"),
        "loss_scaling": (None, "fp16 loss scaling"),
        "ignored": ((), "ignored parameters"),
        "offload": (False, "CPU offload"),
        "shard_placement": ("dim0", "Shard(1) placements"),
        "prefetch": (None, "explicit prefetching"),
        "replica_sync_last": (False, "replica_sync_last (the stage decides what each backward reduces)"),
        "reshard_after_backward_last": (False, "reshard_after_backward_last (the stage decides it)"),
        "grad_reduction": ("avg", "a sum reduction"),
        "unfreeze_step": (None, "unfreezing mid-run"),
        "ep": (1, "expert parallelism"),
        "compile": (None, "torch.compile (compiled stages were not tried)"),
    },
}


def check_not_beside(case, composition: str) -> None:
    """Refuse, naming the field, what the reference does not model beside `composition` (on)."""
    degree = getattr(case, composition)
    for name, (off, why) in NOT_BESIDE[composition].items():
        value = getattr(case, name)
        check(
            value == off,
            name,
            f"{off!r} with {composition}={degree}: {why} beside {WHAT[composition]} is not modelled",
            value,
        )


def off_beside(composition: str) -> dict[str, Any]:
    """What a draw of `composition` turns off: every row but a user's step (drawn off already
    wherever the step is not pinned)."""
    return {name: off for name, (off, _) in NOT_BESIDE[composition].items() if name != "step"}


def pinned_beside(composition: str, case, pins: dict[str, Any]) -> bool:
    """Whether the draw's pins ask for something `composition` does not take (a field pinned on,
    or any sub-field of it): then the composition is drawn off."""
    return any(
        (name in pins and getattr(case, name) != off) or any(k.startswith(name + ".") for k in pins)
        for name, (off, _) in NOT_BESIDE[composition].items()
    )


def beside_another(composition: str, case) -> bool:
    """Whether `case` was drawn another composition that `composition` is not modelled beside
    (a row's field that is itself a composition, on): the earlier draw stands, this one is not
    drawn (turning the other off would draw it less often than its own draw means to)."""
    return any(name in NOT_BESIDE and getattr(case, name) != off for name, (off, _) in NOT_BESIDE[composition].items())


def check_resumed_degrees(case) -> None:
    """A resume's change of ep or pp degree (`resume_ep`, `resume_pp`, docs/resume.md). DCP
    reshards what changes: the experts are DTensors over the ep dim, and a pipeline rank's copy of
    the model keeps the model's own names, so its stages' keys are the unsplit model's whatever
    the split. The resumed run's own case validates the rest (naming the `resume_` field). One
    thing no load can do: a pipeline's tied embedding is two copies (`tok_embeddings.weight` on
    the first stage, `output.weight` on the last), and without a pipeline one parameter, saved
    (with its optimizer state) under its first name only; a resume into stages has no key for
    the last stage's copy (DCP: "Missing key in checkpoint state_dict"). Out of stages it loads
    either copy, the same values."""
    pp = case.resume_pp
    if pp is None or pp == 1 or case.pp > 1:
        return
    model = case.model
    check(
        not (model.kind == "transformer" and model.tie_embeddings),
        "resume_pp",
        "1 (or null) after pp=1 with tied embeddings: the checkpoint holds the tied weight once"
        " ('tok_embeddings.weight'), and the last stage's copy ('output.weight') has no key to load",
        pp,
    )
