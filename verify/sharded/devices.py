"""Which GPUs a process's rank pools may use: under `pytest -n N` on a GPU runner every xdist
worker gets its own disjoint, contiguous slice of the visible GPUs, so two workers' pools never
share a device (NCCL would deadlock or mix up streams).

The slicing is a pure function, unit-tested on this CPU-only machine; the pool only copies its
result into the workers' CUDA_VISIBLE_DEVICES (that path runs only where CUDA is present).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


class DeviceError(RuntimeError):
    """Not enough GPUs for the workers or the world size asked for; the message says what to change."""


def worker_index(env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(this process's xdist worker index, number of workers); (0, 1) outside pytest-xdist."""
    name = env.get("PYTEST_XDIST_WORKER", "")
    if not name.startswith("gw"):
        return 0, 1
    count = int(env.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    index = int(name[2:])
    return index, max(count, index + 1)


def slice_devices(devices: Sequence[str], index: int, count: int) -> list[str]:
    """Worker `index` of `count`: its contiguous share of `devices`, disjoint from every other
    worker's; the first `len(devices) % count` workers get one device more."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"worker index {index} out of range for {count} workers")
    if len(devices) < count:
        raise DeviceError(
            f"{count} pytest-xdist workers but only {len(devices)} GPUs: each worker needs its own;"
            f" run with -n {max(1, len(devices))} or fewer"
        )
    base, extra = divmod(len(devices), count)
    start = index * base + min(index, extra)
    return list(devices[start : start + base + (1 if index < extra else 0)])


def visible_devices(env: Mapping[str, str] = os.environ, device_count: int = 0) -> list[str]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else 0..device_count-1."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(device_count)]


def devices_for_pool(world_size: int, env: Mapping[str, str] = os.environ, device_count: int = 0) -> list[str]:
    """The GPU ids (one per rank) a pool of `world_size` ranks in this process should see."""
    index, count = worker_index(env)
    mine = slice_devices(visible_devices(env, device_count), index, count)
    if len(mine) < world_size:
        raise DeviceError(
            f"world size {world_size} needs {world_size} GPUs, but this pytest-xdist worker has"
            f" {len(mine)} ({','.join(mine) or 'none'}): use fewer workers (-n) or smaller world sizes"
        )
    return mine[:world_size]


def pool_env(world_size: int) -> dict[str, str]:
    """Environment additions for a pool's rank processes: CUDA_VISIBLE_DEVICES set to this
    worker's slice when CUDA is present (rank r then uses cuda:r of that slice); nothing on CPU."""
    import torch

    if os.environ.get("FSDP_VERIFY_DEVICE", "") == "cpu" or not torch.cuda.is_available():
        return {}
    devices = devices_for_pool(world_size, os.environ, torch.cuda.device_count())
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices)}
