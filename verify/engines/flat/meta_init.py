"""Meta-device materialisation, in the order seed 004 arrived at after a week:

1. construct the model on the meta device (no memory; shapes only);
2. `fully_shard` every unit (it only records which parameters each unit will own);
3. `materialize`: allocate real tensors, re-tie shared parameters (`to_empty` makes a separate
   tensor for each name of a tied weight), initialise with the model's own init in its own
   order from an explicit CPU generator, then flatten and shard.

Two of seed 004's bugs live here. The CPU and CUDA generators give different numbers for one seed,
so initialise on the CPU. And whatever constructing the model draws from the global generator
shifts everything initialised after it: save the global RNG state before and restore it after, so
that building on meta leaves the stream exactly where an eager build would have.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fsdp_verify.engines.flat.api import shard_all, units


def construct_on_meta(construct: Callable[[], nn.Module]) -> nn.Module:
    """`construct()` under the meta device, leaving the global RNG where it was."""
    rng = torch.get_rng_state()
    with torch.device("meta"):
        model = construct()
    torch.set_rng_state(rng)
    return model


def materialize(model: nn.Module, init: Callable[[nn.Module], None], device: str | torch.device = "cpu") -> nn.Module:
    model.to_empty(device=device)
    for unit in units(model):
        for slot in unit.slots:
            first = getattr(*slot.uses[0])
            for owner, attr in slot.uses[1:]:
                owner._parameters[attr] = first  # re-tie
    init(model)
    return shard_all(model)
