"""Where records travel between processes on one host: a file of the sender's own in a memory
directory (the pool's, on /dev/shm), rewritten case after case.

A rank's pieces of the records (verify/sharded/collect.py) and rank 0's whole trace for the pool
used to travel through gloo and a pipe: 34 MB of a medium model's pieces took 65 ms through gloo,
its 70 MB trace 240 ms to pack and pipe. Written to a file they cost a copy, and a copy into a
fresh tmpfs file a page allocation per 4 KB too (42 ms for the 34 MB); rewritten into the same
file every case, whose pages are already there, 4 ms, and read back 2.5 ms.

The reader copies what it reads (nothing points into the file afterwards), and must have read a
fill before the writer's next one begins: a case's pieces are read before its last collective
ends (`Collector.finish`), a pool's trace before the pool sends the next case. A file keeps the
size of its largest fill until `release_arenas`, or until its directory goes with the pool.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from fsdp_verify.trace import ALIGN, Key, Trace, packed_entry


class Arena:
    """One sender's file. `begin` starts a fill, `add` appends a record (one copy, into the
    file), `header` describes the fill for `read_fill` in another process. A write that fails
    (a full tmpfs) raises OSError; the caller then sends another way."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self.entries: list[list[Any]] = []
        self.nbytes = 0

    def begin(self) -> Arena:
        self.entries, self.nbytes = [], 0
        return self

    def add(self, key: Key, t: torch.Tensor) -> None:
        """Laid out as `Trace.pack` lays a record out."""
        t = t.detach().contiguous().cpu()
        size = t.numel() * t.element_size()
        offset = self.nbytes + (-self.nbytes % ALIGN)
        if size:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            data, done = memoryview(t.reshape(-1).view(torch.uint8).numpy()), 0
            while done < size:  # pwrite may write less than asked
                done += os.pwrite(self._fd, data[done:], offset + done)
        self.entries.append(packed_entry(key, t, offset))
        self.nbytes = offset + size

    def add_trace(self, trace: Trace) -> Arena:
        for key, t in trace.records.items():
            self.add(key, t)
        return self

    def header(self, side: str, meta: dict[str, Any]) -> dict[str, Any]:
        return {"side": side, "meta": meta, "records": self.entries, "nbytes": self.nbytes, "path": self.path}

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class Fill:
    """The records a header describes (an `Arena.header`, or `Trace.pack`'s with its bytes in
    `buf`), read one at a time: `read_into` puts one straight where it goes (rank 0 reads another
    rank's rows into its full tensors: one copy, not a read and then a copy)."""

    def __init__(self, header: dict[str, Any], buf: torch.Tensor | None = None):
        self.side, self.meta, self.buf = header["side"], header["meta"], buf
        self.entries = {(s, p, n): (getattr(torch, d), shape, o, b) for s, p, n, d, shape, o, b in header["records"]}
        self._fd = os.open(header["path"], os.O_RDONLY) if buf is None and header["nbytes"] else None
        self._path = header.get("path")

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def shape(self, key: Key) -> list[int]:
        return self.entries[key][1]

    def read(self, key: Key) -> torch.Tensor:
        dtype, shape, _, _ = self.entries[key]
        out = torch.empty(shape, dtype=dtype)
        self.read_into(key, out)
        return out

    def read_into(self, key: Key, out: torch.Tensor) -> None:
        """`out`: a contiguous CPU tensor of the record's size (a slice of rows of a full one)."""
        _, _, offset, nbytes = self.entries[key]
        if out.numel() * out.element_size() != nbytes or not out.is_contiguous():
            raise ValueError(f"record {key}: {nbytes} bytes into a tensor of {out.numel() * out.element_size()}")
        if not nbytes:
            return
        dest = out.reshape(-1).view(torch.uint8)
        if self._fd is None:
            assert self.buf is not None
            dest.copy_(self.buf[offset : offset + nbytes])
            return
        view, done = memoryview(dest.numpy()), 0
        while done < nbytes:  # preadv may read less than asked
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise OSError(f"{self._path}: the file ends {nbytes - done} bytes into record {key}")
            done += got

    def trace(self) -> Trace:
        return Trace(self.side, {key: self.read(key) for key in self.entries}, self.meta)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_fill(header: dict[str, Any]) -> Trace:
    """The records an `Arena.header` describes, copied out of the sender's file."""
    fill = Fill(header)
    try:
        return fill.trace()
    finally:
        fill.close()


_ARENAS: dict[tuple[str, str], Arena] = {}


def arena(directory: str, name: str) -> Arena:
    """This process's arena `name` in `directory`, made once and kept (its pages are reused)."""
    key = (directory, name)
    if key not in _ARENAS:
        _ARENAS[key] = Arena(os.path.join(directory, f"arena-{name}-{os.getpid()}"))
    return _ARENAS[key]


def release_arenas() -> None:
    """Close and remove this process's arena files (at the end of a worker, a run in place)."""
    for made in _ARENAS.values():
        made.close()
    _ARENAS.clear()
