"""Minimal repros: shrink a failing Case (`shrink.py`) and write and replay Case files (`files.py`)."""
