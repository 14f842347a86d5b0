"""Precision contract: the dtypes the sharded run used (verify/probes/precision.py) against the
ones its MixedPrecisionPolicy declares, as FSDP2 defines them (seed 000):

| stage            | expected                                                     |
|------------------|--------------------------------------------------------------|
| sharded          | float32 (the master weights)                                 |
| forward_params   | param_dtype (float32 if unset)                               |
| forward_inputs   | param_dtype, when cast_forward_inputs and param_dtype is set |
| backward_params  | param_dtype                                                  |
| backward_grads   | param_dtype (gradients are computed in the compute dtype)    |
| reduce           | reduce_dtype (else param_dtype, else float32)                |
| grads            | float32 (the reduced gradient is cast back to the shard's)   |
| optim_state      | float32                                                      |
| outputs          | output_dtype, when set                                       |

A mismatch is a finding even where the numbers agree. One finding per stage, at the first step
it was seen, naming the parameter (or unit) and both dtypes.
"""

from __future__ import annotations

from fsdp_verify.case import Case
from fsdp_verify.compare.finding import Finding
from fsdp_verify.trace import Trace
from fsdp_verify.units import owner_of_param as owning_unit

COMPARATOR = "PrecisionContract"


def expected_dtypes(case: Case) -> dict[str, str]:
    """Stage -> the dtype the policy demands there (stages absent here are not judged)."""
    p = case.precision
    param = p.param_dtype or "fp32"
    expected = {
        "sharded": "fp32",
        "forward_params": param,
        "backward_params": param,
        "backward_grads": param,
        "reduce": p.reduce_dtype or param,
        "grads": "fp32",
        "optim_state": "fp32",
    }
    if p.cast_forward_inputs and p.param_dtype is not None:
        expected["forward_inputs"] = p.param_dtype
    if p.output_dtype is not None:
        expected["outputs"] = p.output_dtype
    return expected


def check_precision(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    seen = got.meta.get("precision")
    if seen is None:
        return [
            Finding(
                0,
                "precision",
                "<probe>",
                False,
                "missing",
                COMPARATOR,
                "the sharded trace holds no precision record (was the PrecisionProbe run?)",
            )
        ]
    expected = expected_dtypes(case)
    uncast = _units_that_do_not_cast(case, ref)
    findings: list[Finding] = []
    reported: set[str] = set()
    for step in sorted(seen["steps"], key=int):
        for stage, names in sorted(seen["steps"][step].items()):
            want = expected.get(stage)
            if want is None or stage in reported:
                continue
            for name, dtypes in sorted(names.items()):
                if stage == "forward_inputs" and name in uncast:
                    continue
                if dtypes != [want]:
                    reported.add(stage)
                    findings.append(
                        Finding(
                            int(step),
                            "precision",
                            f"{stage}:{name}",
                            False,
                            "contract",
                            COMPARATOR,
                            f"{_STAGE_TEXT[stage]} {name!r} in {' and '.join(dtypes)}, the policy says {want}",
                        )
                    )
                    break
    return findings


def _units_that_do_not_cast(case: Case, ref: Trace) -> set[str]:
    """Units whose inputs the engine leaves as they come, as it declares (FSDP1: a non-root unit
    holding no parameters of its own), by the name the probe logs them under."""
    from fsdp_verify.engines import engine_arithmetic

    if engine_arithmetic(case.engine).casts_inputs_without_params:
        return set()
    owners = {owning_unit(case.wrap_plan, n) for s, phase, n in ref.records if s == 0 and phase == "init"}
    return {u for u in case.wrap_plan if u and u not in owners}


def precision_summary(case: Case, ref: Trace, got: Trace) -> str | None:
    seen = got.meta.get("precision")
    if seen is None:
        return None
    expected = expected_dtypes(case)
    stages = sorted({s for stages in seen["steps"].values() for s in stages if s in expected})
    return f"dtypes at {len(stages)} stages as the policy says ({case.precision.describe()}): {', '.join(stages)}"


_STAGE_TEXT = {
    "sharded": "sharded parameter",
    "forward_params": "forward computed with the unsharded parameter",
    "forward_inputs": "inputs of the shard unit",
    "backward_params": "backward computed with the unsharded parameter",
    "backward_grads": "backward produced the gradient of",
    "reduce": "gradients reduced",
    "grads": "reduced gradient of",
    "optim_state": "optimizer state",
    "outputs": "outputs of the shard unit",
}
