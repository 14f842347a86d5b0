"""The trained model exported whole (docs/resume.md): a full state dict (`full_state_dict=True,
cpu_offload=True`: every rank takes part in the gathers, rank 0 gets the CPU tensors) written as
`model.safetensors`, the file a plain `nn.Module` (`load_state_dict`) or a `transformers` model
(`from_pretrained` on the folder) loads for inference on one device."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

FILE = "model.safetensors"


def export_safetensors(module: nn.Module, folder: str | Path) -> Path | None:
    """A collective; rank 0 writes FOLDER/model.safetensors and returns its path. Tied weights
    (one tensor under two names) are written once, under their first name, as `transformers`
    saves them (it re-ties the other on load); safetensors refuses shared storage."""
    from safetensors.torch import save_file

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        tensors[name] = t.detach().contiguous()
    path = Path(folder) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path
