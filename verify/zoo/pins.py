"""The pins several of the zoo's mutant modules share (a pin narrows a bug's case strategy to
where it can show: verify/zoo/catalog.py); a pin one module alone uses stays in that module."""

from __future__ import annotations

from hypothesis import strategies as st

MICROBATCHES = st.integers(2, 3)
# One case per example costs ~0.2-1 s; keep the zoo's cases at the cheap end.
CHEAP = {"steps": st.integers(1, 2)}

# A checkpoint and resume drawn in every case (docs/resume.md): the bug is in the load.
RESUME = {**CHEAP, "resume": True}

# Pipeline parallelism (issue 40, docs/pipeline-parallel.md).
PIPELINE = {**CHEAP, "pp": 2, "microbatches": MICROBATCHES}
