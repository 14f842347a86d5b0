"""PyTorch's own bug, reproduced with plain torch (no fsdp-verify code): FSDP2 over gloo (the CPU)
in torch 2.8 sums the ranks' gradients where it should average them (pytorch/pytorch#162338,
"Incorrect AVG reduction for GLOO": FSDP2 asked gloo for ReduceOp.AVG, which its reduce-scatter
did not do). Fixed in 2.9 (fsdp-verify supports 2.11 on; verify/torch_support.py says why).
Under a fixed torch this passes; it xfails (strictly) on an older one,
and fails outright if a later release breaks it again."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

# The ranks fork from a server that imported torch once (a fresh interpreter per rank costs
# 1.5-2 s of CPU); the bug does not depend on how the processes start.
mp.set_forkserver_preload(["torch", "torch.distributed"])


def _rank(rank: int, world: int, rendezvous: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2, bias=False)
        fully_shard(model, mesh=mesh)
        model(torch.full((1, 4), float(rank + 1))).sum().backward()  # gradient (rank + 1) * ones
        grad = model.weight.grad.full_tensor()
        if rank == 0:
            torch.save(grad, out)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # No teardown: gloo's aborted a rank in loaded CI runs; the gradient is saved, every rank past the barrier.
    os._exit(0)


@pytest.mark.xfail(
    TORCH < (2, 9),
    strict=True,
    raises=AssertionError,
    reason="torch 2.8: FSDP2 over gloo sums the gradients instead of averaging (pytorch/pytorch#162338)",
)
def test_fsdp2_over_gloo_averages_the_ranks_gradients():
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grad.pt")
        mp.start_processes(
            _rank, args=(world, os.path.join(tmp, "rendezvous"), out), nprocs=world, start_method="forkserver"
        )
        grad = torch.load(out)
    # Data parallelism: the average of the ranks' gradients, (1 + 2) / 2 = 1.5 (torch 2.8: 3.0).
    assert torch.equal(grad, torch.full((2, 4), 1.5)), grad
