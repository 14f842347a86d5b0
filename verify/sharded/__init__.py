"""The sharded side: a pool of long-lived rank processes (`pool.py`, `worker.py`), the training
loop each rank runs around the engine (`loop.py`), full tensors from shards (`gather.py`), GPUs
per pytest-xdist worker (`devices.py`), and the same loop in place under torchrun (`torchrun.py`)."""
