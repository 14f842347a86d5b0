"""What both sides do alike, from the Case: the global batches (`data.py`), the loss (`loss.py`),
the optimizer (`optim.py`), the random streams (`rng.py`) and the policy's casts (`casts.py`)."""
