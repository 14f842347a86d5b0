"""Resumes across a change of the ep or pp degree (what one load cannot do). What is not modelled
beside each dimension is the one table in verify/dims/together.py."""

from __future__ import annotations

from fsdp_verify.validation import check


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
