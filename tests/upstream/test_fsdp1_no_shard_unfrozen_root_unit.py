"""PyTorch's own bug, reproduced with plain torch (no fsdp-verify code): FSDP1 NO_SHARD never trains
the root unit's own parameters once they were all frozen through a forward, even after they are
unfrozen.

A fine-tuning recipe wraps a model with FSDP1 (`use_orig_params=True`, which allows frozen and
trainable parameters and changes of `requires_grad` later: torch's
`_reset_flat_param_grad_info_if_needed`, pytorch/pytorch#104186), with the head frozen and left
to the root FSDP instance, the body its own unit. It trains a step, then unfreezes the head. Under
FULL_SHARD and SHARD_GRAD_OP (two ranks) the head then gets its gradient; under NO_SHARD (world
size 1, or a (W, 1) mesh) it never does: after the first forward and backward the root's original
parameters are no longer registered on their modules (`named_parameters()` no longer lists them;
the modules hold plain tensor views of the FlatParameter instead), so the gradient of the next
backward lands on those views, and the `nn.Parameter`s the optimizer holds keep `.grad = None`
and never move. Silently: no error, the loss still goes down (torch 2.13, measured; the same at
(2, 1)). Unfreezing before the first forward, or a frozen unit that is not the root, trains.
Found by `fsdp-verify fuzz --engine fsdp1` (seed 20263945, regression 4e6cbe2adeff: an MLP whose
root unit held only routed experts and their gate, all frozen, unfrozen at step 2).
"""

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    model[2].requires_grad_(False)  # the head, frozen when wrapped
    return model


def _head_grad_after_unfreeze(x: torch.Tensor, fsdp: bool) -> torch.Tensor | None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    model = _model()
    head = model[2].weight
    if fsdp:
        options = dict(sharding_strategy=ShardingStrategy.NO_SHARD, use_orig_params=True, device_id=torch.device("cpu"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NO_SHARD's deprecation warning
            model[0] = FSDP(model[0], **options)  # the body its own unit; the head stays with the root
            model = FSDP(model, **options)
    # Over every parameter, the frozen head too (held from before wrapping: FSDP1 hides it from
    # `parameters()` after the first forward, see above).
    trained = list(model.parameters())
    optimizer = torch.optim.SGD(trained + [head] * all(p is not head for p in trained), lr=0.1)
    model(x).sum().backward()  # a step with the head frozen
    optimizer.step()
    optimizer.zero_grad()
    head.requires_grad_(True)  # unfrozen: the parameter the optimizer holds
    model(x).sum().backward()
    return None if head.grad is None else head.grad.detach().clone()


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,  # the gradient below; any other error is a failure
    reason="torch 2.13: FSDP1 NO_SHARD never gives the root unit's parameters a gradient once they "
    "were all frozen through a forward, even after they are unfrozen",
)
def test_fsdp1_no_shard_trains_the_root_units_parameters_once_unfrozen():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1)
        try:
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
            expected = _head_grad_after_unfreeze(x, fsdp=False)
            got = _head_grad_after_unfreeze(x, fsdp=True)
        finally:
            dist.destroy_process_group()
    assert expected is not None
    assert got is not None and torch.equal(got, expected), (got, expected)
