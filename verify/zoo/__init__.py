"""The bug zoo: mutant engines with injected bugs (`mutants.py`) and the catalogue that says where
each can show (`catalog.py`); `fsdp-verify selftest` must catch every one."""
