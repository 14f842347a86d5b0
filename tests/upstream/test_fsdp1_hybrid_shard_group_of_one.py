"""PyTorch's own bug, reproduced with plain torch (no fsdp-verify code): FSDP1 HYBRID_SHARD on a
(replicate=2, shard=1) device mesh never averages gradients over the replicas.

FSDP1 (`torch/distributed/fsdp/_init_utils.py`) takes the shard group (mesh dim 1, one rank) as
its process group and computes the gradient divide factors for the whole data-parallel world
(2 ranks); then `_init_core_state` sees a process group of size 1 and switches the strategy to
NO_SHARD, whose `_reduce_grad_no_shard` all-reduces over that one-rank group. The all-reduce over
the replicate group (`_inter_node_pg`), which only the HYBRID path issues, never happens: each
rank's gradient is its own divided by 2, and the replicas drift apart. Only the warning "FSDP is
switching to use `NO_SHARD`" hints at it. fsdp-verify's fsdp1 engine therefore runs a (W, 1)
mesh as NO_SHARD over the replicate group (verify/engines/fsdp1.py), and the zoo's
`fsdp1_no_shard_not_all_reduced` is this behaviour.
"""

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The ranks fork from a server that imported torch once (a fresh interpreter per rank costs
# 1.5-2 s of CPU); the bug does not depend on how the processes start.
mp.set_forkserver_preload(["torch", "torch.distributed"])


def _rank(rank: int, world: int, rendezvous: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    # A file rendezvous, not a port: a free port picked and released can be taken by another
    # test's process group in a parallel run before this one binds it (seen as a rank aborting).
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)  # the same initial weight on every rank
        model = torch.nn.Linear(4, 1, bias=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fsdp = FSDP(
                model,
                device_mesh=mesh,
                sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                use_orig_params=True,
                device_id=torch.device("cpu"),
            )
        x = torch.full((1, 4), float(rank + 1))  # each rank its own input: gradient (rank + 1) * ones
        fsdp(x).sum().backward()
        grads = [torch.empty(4) for _ in range(world)]
        dist.all_gather(grads, fsdp.weight.grad.reshape(-1).detach())
        if rank == 0:
            torch.save(torch.stack(grads), out)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without tearing down: gloo's teardown (destroy_process_group, or the destructors of the
    # groups DeviceMesh keeps at interpreter exit) aborted a rank twice in loaded full runs
    # ("terminate called without an active exception", SIGABRT: a joinable thread destroyed).
    # The teardown is not what this test is about; the gradients are saved and both ranks are past
    # the barrier, so each rank ends here without running any destructor.
    os._exit(0)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,  # the gradients below; any other error is a failure
    reason="torch 2.13: FSDP1 HYBRID_SHARD with a shard group of one switches to NO_SHARD over that "
    "group and never all-reduces over the replicas (each rank keeps its own gradient / world)",
)
def test_fsdp1_hybrid_shard_with_a_shard_group_of_one_averages_over_the_replicas():
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grads.pt")
        mp.start_processes(
            _rank, args=(world, os.path.join(tmp, "rendezvous"), out), nprocs=world, start_method="forkserver"
        )
        grads = torch.load(out)
    # Data parallelism: every rank holds the average of the ranks' gradients, (1 + 2) / 2 = 1.5.
    # What torch 2.13 gives: rank 0 holds 1 / 2, rank 1 holds 2 / 2.
    assert torch.equal(grads, torch.full((world, 4), 1.5)), grads
