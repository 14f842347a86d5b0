"""An FSDP2 engine that talks on every rank, every case: a library warning (Python's `warnings`)
and a library's WARNING log record (both tallied into the report), a line that is no warning
(straight to stderr, as a C++ library's would be) and an ERROR log record (printed as ever); and
one that crashes after saying why (its last words must reach the terminal)."""

import logging
import os
import sys
import warnings

import torch.distributed as dist

from fsdp_verify.engines.fsdp2 import fully_shard_engine

WARNING = "noisy engine: a library warning"
LINE = "noisy engine: a line that is no warning"
LAST_WORDS = "noisy engine: rank 1 dies now"
LOGGED = "noisy engine: a library's log warning"
LOGGED_ERROR = "noisy engine: a library's log error"
LOGGER = "noisy.library"


def warns_and_writes(model, mesh, spec):
    warnings.warn(WARNING, UserWarning, stacklevel=1)
    logging.getLogger(LOGGER).warning(LOGGED)
    logging.getLogger(LOGGER).error(LOGGED_ERROR)
    sys.stderr.write(LINE + "\n")
    sys.stderr.flush()
    return fully_shard_engine(model, mesh, spec)


def warns_then_crashes(model, mesh, spec):
    warnings.warn(WARNING, UserWarning, stacklevel=1)
    if dist.get_rank() == 1:
        sys.stderr.write(LAST_WORDS + "\n")
        sys.stderr.flush()
        os._exit(9)
    return fully_shard_engine(model, mesh, spec)


warns_and_writes.capabilities = warns_then_crashes.capabilities = fully_shard_engine.capabilities
