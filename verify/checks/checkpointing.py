"""What activation checkpointing changed in the user's model before the run: a `transformers`
config's KV cache turned off on both sides (verify/training/checkpointing.py). Not a judgement: a
passing note the verdict prints, so that a user reading EQUIVALENT knows the run had no cache."""

from __future__ import annotations

from fsdp_verify.case import Case
from fsdp_verify.compare.finding import Finding
from fsdp_verify.trace import Trace
from fsdp_verify.training.checkpointing import CACHE_OFF, cache_note

COMPARATOR = "ActivationCheckpointing"


def checkpointing_notes(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    turned_off = got.meta.get(CACHE_OFF)
    if not turned_off:
        return []
    return [Finding(0, "build", "<use_cache>", True, "note", COMPARATOR, cache_note(turned_off))]
