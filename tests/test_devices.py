"""GPU slicing per pytest-xdist worker: disjoint, covering, clear errors. Pure functions (no GPU here)."""

import pytest

from fsdp_verify.sharded.devices import (
    DeviceError,
    devices_for_pool,
    pool_env,
    slice_devices,
    visible_devices,
    worker_index,
)


@pytest.mark.parametrize(("n_devices", "n_workers"), [(8, 1), (8, 2), (8, 3), (7, 4), (4, 4), (5, 2)])
def test_worker_slices_are_disjoint_contiguous_and_cover_every_gpu(n_devices, n_workers):
    devices = [str(i) for i in range(n_devices)]
    slices = [slice_devices(devices, w, n_workers) for w in range(n_workers)]
    flat = [d for s in slices for d in s]
    assert flat == devices  # disjoint, in order, nothing lost
    sizes = [len(s) for s in slices]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_slices_keep_the_ids_of_an_existing_cuda_visible_devices_list():
    assert slice_devices(["3", "5", "6", "7"], 1, 2) == ["6", "7"]


def test_fewer_gpus_than_workers_is_a_clear_error():
    with pytest.raises(DeviceError, match=r"3 pytest-xdist workers but only 2 GPUs.*-n 2"):
        slice_devices(["0", "1"], 0, 3)


def test_bad_worker_index_is_rejected():
    with pytest.raises(ValueError):
        slice_devices(["0", "1"], 2, 2)


def test_worker_index_from_the_xdist_environment():
    assert worker_index({}) == (0, 1)
    assert worker_index({"PYTEST_XDIST_WORKER": "master"}) == (0, 1)
    assert worker_index({"PYTEST_XDIST_WORKER": "gw3", "PYTEST_XDIST_WORKER_COUNT": "4"}) == (3, 4)


def test_visible_devices_prefers_cuda_visible_devices():
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "2, 4"}, device_count=8) == ["2", "4"]
    assert visible_devices({}, device_count=3) == ["0", "1", "2"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}, device_count=3) == []


def test_pool_of_a_worker_gets_one_gpu_per_rank_from_its_own_slice():
    env = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    assert devices_for_pool(2, env, device_count=8) == ["4", "5"]
    assert devices_for_pool(4, env, device_count=8) == ["4", "5", "6", "7"]
    other = devices_for_pool(4, {**env, "PYTEST_XDIST_WORKER": "gw0"}, device_count=8)
    assert not set(other) & {"4", "5", "6", "7"}


def test_world_size_larger_than_the_slice_is_a_clear_error():
    env = {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "4"}
    with pytest.raises(DeviceError, match="world size 4 needs 4 GPUs.*has 2"):
        devices_for_pool(4, env, device_count=8)


def test_cpu_pools_get_no_device_environment():
    """On this CPU-only machine the pool's workers see no CUDA_VISIBLE_DEVICES change."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert pool_env(2) == {}
