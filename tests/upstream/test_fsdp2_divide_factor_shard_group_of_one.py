"""PyTorch's own bug, reproduced with plain torch (no fsdp-verify code): FSDP2 divides a unit's
gradient twice by its `set_gradient_divide_factor` when its reduce-scatter group has one rank and
the reduction is a SUM with a post-division: with `set_force_sum_reduction_for_comms(True)` (what
gloo needs, having no PREMUL_SUM), or with an fp16 reduce dtype (always pre/post-divided).

`foreach_reduce` skips the reduce-scatter of a one-rank group and copies `input / factor` instead
("account for a possible gradient_divide_factor"), then post-divides by the factor
`_get_gradient_divide_factors` returned as well. A group of one is what expert parallelism gives
the experts' unit when the ep degree equals the shard dim (torchtitan's `efsdp` of size 1, its
experts' divide factor the data-parallel size), and an HSDP mesh (R, 1). Found by fsdp-verify on
expert parallelism 2 at 2 ranks (issue 40): the experts' gradients came out half the reference's.
fsdp-verify's engine forces the sum only where the experts' reduce-scatter group has more than
one rank, and its Case refuses an fp16 reduction there (verify/engines/expert_parallel.py).
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist


def _grads(rendezvous: str) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        out = []
        for force_sum, reduce_dtype in ((True, None), (False, torch.float16)):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2, bias=False)
            fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
            model.set_gradient_divide_factor(2.0)
            model.set_force_sum_reduction_for_comms(force_sum)
            model(torch.ones(1, 4)).sum().backward()  # gradient: ones
            out.append(model.weight.grad.full_tensor().float())
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="torch 2.13: FSDP2 divides by the gradient divide factor twice when the reduce-scatter group has one"
    " rank and the sum is forced or the reduce dtype is fp16",
)
def test_fsdp2_divides_once_by_the_factor_on_a_shard_group_of_one():
    with tempfile.TemporaryDirectory() as tmp:
        forced, fp16 = _grads(os.path.join(tmp, "rendezvous"))
    # The gradient (ones) divided by the factor 2 once: 0.5 (torch 2.13: 0.25 in both).
    assert torch.equal(forced, torch.full((2, 4), 0.5)), forced
    assert torch.equal(fp16, torch.full((2, 4), 0.5)), fp16
