"""The optimizer both sides build (verify/training/optim.py) takes the multi-tensor ("foreach")
update only where it gives the single-tensor update's bits: fp32 and fp64, on plain tensors and on
DTensor shards over real gloo ranks. A rule that took foreach in bf16 fails here (SGD's and AdamW's
weight decay round otherwise), as would a DTensor update that differed from the plain one."""

from __future__ import annotations

import itertools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from fsdp_verify.case_specs import OptimSpec
from fsdp_verify.training.optim import foreach_is_exact, make_optimizer
from tests.ranks import spawn

SPECS = [
    OptimSpec(name="sgd", momentum=0.9, weight_decay=0.01),
    OptimSpec(name="adam"),
    OptimSpec(name="adamw", betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
    # State beyond Adam's (docs/optimizers-and-schedules.md): a running sum, a running average
    # with momentum, AMSGrad's running max.
    OptimSpec(name="adagrad", weight_decay=0.01),
    OptimSpec(name="rmsprop", momentum=0.9, weight_decay=0.01),
    OptimSpec(name="adamw", amsgrad=True, betas=(0.9, 0.5), weight_decay=0.1),
]
# Rows that do not split evenly over two ranks, a vector, a scalar-like one.
SHAPES = [(33, 16), (33,), (17, 33), (7,), (1,)]


def _params(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 3).to(dtype) for s in SHAPES]


def _train(optimizer: torch.optim.Optimizer, params: list, grads_of, steps: int = 6) -> list[torch.Tensor]:
    """`steps` updates with gradients from 1e-3 to 1e2; the parameters and every state tensor."""
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = grads_of(i, step)
        optimizer.step()
    whole = [p.detach() for p in params] + [v for p in params for v in optimizer.state[p].values()]
    return [t.full_tensor() if hasattr(t, "full_tensor") else t for t in whole]


def _grads(dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed + 100)
    table = {
        (i, step): (torch.randn(s, generator=g) * 10.0 ** (step - 3)).to(dtype)
        for step in range(6)
        for i, s in enumerate(SHAPES)
    }
    return lambda i, step: table[(i, step)].clone()


def _single_tensor(spec: OptimSpec, params: list) -> torch.optim.Optimizer:
    optimizer = make_optimizer(spec, params)
    for group in optimizer.param_groups:
        group["foreach"] = False
    return optimizer


def _bits(tensors: list[torch.Tensor]) -> list[bytes]:
    return [t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name + "-amsgrad" * s.amsgrad)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_the_update_is_the_single_tensor_update_bit_for_bit(spec, dtype):
    for seed in range(3):
        mine = [torch.nn.Parameter(t) for t in _params(dtype, seed)]
        twin = [torch.nn.Parameter(t) for t in _params(dtype, seed)]
        chosen = make_optimizer(spec, mine)
        assert chosen.param_groups[0]["foreach"] is (dtype != torch.bfloat16)
        got = _train(chosen, mine, _grads(dtype, seed))
        want = _train(_single_tensor(spec, twin), twin, _grads(dtype, seed))
        assert _bits(got) == _bits(want), f"{spec.name} {dtype} seed {seed}"


def test_foreach_is_never_taken_where_it_cannot_run_or_differs():
    fp32 = [torch.zeros(3), torch.zeros(2)]
    assert foreach_is_exact(fp32) and foreach_is_exact([]) and foreach_is_exact([torch.zeros(2, dtype=torch.float64)])
    assert not foreach_is_exact([torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)])
    assert not foreach_is_exact([torch.zeros(3, dtype=torch.float16)])


def _rank_main(rank: int, init: str, out: str) -> None:
    """On two real gloo ranks: the chosen update on DTensor shards (FSDP2's Shard(0)) against the
    single-tensor update on the same shards and on the full plain tensors; and a mix of DTensors
    and plain tensors, which one foreach op cannot take."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    failures = []
    for spec, dtype, seed in itertools.product(SPECS, (torch.float32, torch.float64), range(2)):

        def sharded(_dtype=dtype, _seed=seed):
            return [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in _params(_dtype, _seed)]

        grads = _grads(dtype, seed)

        def shard_grads(i, step, _grads=grads):
            return distribute_tensor(_grads(i, step), mesh, [Shard(0)])

        mine, twin = sharded(), sharded()
        chosen = make_optimizer(spec, mine)
        plain = [torch.nn.Parameter(t) for t in _params(dtype, seed)]
        got = _train(chosen, mine, shard_grads)
        want = _train(_single_tensor(spec, twin), twin, shard_grads)
        whole = _train(_single_tensor(spec, plain), plain, grads)
        if not chosen.param_groups[0]["foreach"]:
            failures.append(f"{spec.name} {dtype}: foreach not taken on DTensors")
        if not _bits(got) == _bits(want) == _bits(whole):
            failures.append(f"{spec.name} {dtype} seed {seed}: the DTensor update differs")
    mixed = [torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Shard(0)])), torch.nn.Parameter(torch.ones(3))]
    optimizer = make_optimizer(OptimSpec(), mixed)
    _train(
        optimizer, mixed, lambda i, step: torch.ones(3) if i else distribute_tensor(torch.ones(4), mesh, [Shard(0)]), 2
    )
    if optimizer.param_groups[0]["foreach"]:
        failures.append("foreach taken on DTensors mixed with plain tensors")
    if rank == 0:
        torch.save(failures, out)
    dist.destroy_process_group()


def test_on_dtensor_shards_over_real_ranks_too():
    with tempfile.TemporaryDirectory(prefix="fsdp-verify-optim-") as tmp:
        out = os.path.join(tmp, "failures.pt")
        spawn(_rank_main, args=(os.path.join(tmp, "init"), out), nprocs=2)
        assert torch.load(out) == []
