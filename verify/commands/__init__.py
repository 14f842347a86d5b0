"""The `fsdp-verify` commands, one module each (`add_arguments(parser)` and `run(args) -> int`),
dispatched by `cli.py`; `options.py` holds the options several commands share, with one spelling."""
