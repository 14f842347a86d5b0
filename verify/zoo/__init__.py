"""The bug zoo: mutant engines with injected bugs (`mutants/`), each with its catalogue entry that
says where it can show (`registry.py`), gathered in `catalog.py`; `fsdp-verify selftest` must
catch every one."""
