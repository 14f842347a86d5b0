"""What the Trainer script and the Accelerate script share, as a user's scripts would: the tiny
model, the data and the FSDP2 wrapping."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from fsdp_verify.models.hf import TINY, tiny_llama


class Tokens(Dataset):
    """64 random sequences of 16 tokens; with `padded`, labels -100 after a random length, so
    ranks hold different numbers of tokens."""

    def __init__(self, samples: int = 64, length: int = 16, padded: bool = True):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, TINY["vocab_size"], (samples, length), generator=g)
        self.labels = self.ids.clone()
        valid = torch.randint(4, length + 1, (samples,), generator=g)
        if padded:
            self.labels[torch.arange(length) >= valid[:, None]] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # tiny_llama draws its initial values from the global generator
    return tiny_llama()


def shard(model: torch.nn.Module) -> None:
    """fully_shard (FSDP2) each decoder layer, then the root, over every rank (gloo on CPU)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
