"""ShardSpec: what an engine is told about how to shard. A stable contract for plug-in engines."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_verify.case import Case, PrecisionSpec
from fsdp_verify.dtypes import to_torch


@dataclass(frozen=True)
class ShardSpec:
    # Module FQNs to shard, children before parents; "" is the root and comes last.
    wrap: tuple[str, ...]
    # Always set; default fields mean full precision.
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | int
    # The whole Case, for engines (and mutants) that need more than the three fields above.
    case: Case | None = None

    @classmethod
    def from_case(cls, case: Case) -> ShardSpec:
        return cls(
            wrap=case.wrap_plan,
            mp_policy=policy_of(case.precision),
            reshard_after_forward=case.reshard_after_forward,
            case=case,
        )


def policy_of(spec: PrecisionSpec) -> MixedPrecisionPolicy:
    """The Case's precision as FSDP2's MixedPrecisionPolicy."""
    return MixedPrecisionPolicy(
        param_dtype=to_torch(spec.param_dtype),
        reduce_dtype=to_torch(spec.reduce_dtype),
        output_dtype=to_torch(spec.output_dtype),
        cast_forward_inputs=spec.cast_forward_inputs,
    )
