"""What a team's GPU job runs (.github/workflows/gpu.yml): generated cases through the pytest
plugin, FSDP2 (or `--fsdp-engine`) against the reference, under `pytest -n auto`. Each xdist worker
gets its own slice of the runner's GPUs (fsdp_verify.sharded.devices), so set the number of
workers to GPUs // the largest world size (PYTEST_XDIST_AUTO_NUM_WORKERS, as the workflow does)."""

from hypothesis import given
from hypothesis import strategies as st


@given(data=st.data())
def test_the_engine_equals_the_reference(fsdp_cases, fsdp_property, data):
    fsdp_property(data.draw(fsdp_cases()))
