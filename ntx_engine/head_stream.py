"""The embedding table and output head read from storage every token: the CPU-only case where
the RAM budget cannot even hold them (SmolLM2-135M's tied table is 28.7 MB of a 40 MB budget).

The planner (`planner.make_plan`, unified budgets only) chooses this when the head does not fit
beside the smallest ring; the table then costs two piece buffers of RAM instead of its size,
and `head_bytes` more storage reads per token. Each piece of rows is read into a reused buffer
through the storage reader (which drops what it read from the page cache: storage means
storage) and multiplied by the backend's own kernels, so every logit is the dot product the
resident table gives, row by row. The embedding reads just the rows of the token ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np

HEAD_PIECE_BYTES = 1 << 20  # rows of the head read and multiplied at a time
HEAD_PIECES = 2  # piece buffers the planner reserves (one being filled, one in use)


def head_reserve(head_bytes: int) -> int:
    """RAM the streamed head takes instead of head_bytes."""
    return min(head_bytes, HEAD_PIECES * HEAD_PIECE_BYTES)


class StreamedMatrix:
    """A (rows, k) GGUF matrix left on storage; `embed` and `matmul` read what they need."""

    def __init__(self, gf: Any, name: str, backend: Any, reader: Any, base_offset: int = 0,
                 piece_bytes: int = HEAD_PIECE_BYTES) -> None:
        info = gf.tensors[name]
        self.name, self.ggml_type, self.backend = name, info.ggml_type, backend
        self.rows, self.k = info.shape
        self.offset = base_offset + info.offset
        self.row_bytes = info.nbytes // self.rows
        self.piece_rows = max(1, piece_bytes // self.row_bytes)
        self.reader = reader
        self._buf = np.empty(self.piece_rows * self.row_bytes, np.uint8)
        self.bytes_read = 0  # since creation: the storage bytes the head cost

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.k

    def _read(self, r0: int, n: int) -> np.ndarray:
        nbytes = n * self.row_bytes
        view = self._buf[:nbytes]
        self.reader.read_into(self.offset + r0 * self.row_bytes, nbytes, view)
        self.bytes_read += nbytes
        return view

    def embed(self, ids: np.ndarray) -> Any:
        """backend.embed over just the rows of ids (read one by one, in the order given)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            raise ValueError(f"{self.name}: token id out of range [0, {self.rows})")
        raw = np.empty((ids.size, self.row_bytes), np.uint8)
        for j, t in enumerate(ids):
            raw[j] = self._read(int(t), 1)
        table = self.backend.matrix(raw.reshape(-1), self.ggml_type, (ids.size, self.k), self.name)
        return self.backend.embed(table, np.arange(ids.size))

    def matmul(self, x: Any) -> np.ndarray:
        """x (n, k) . W^T as numpy (n, rows), piece by piece."""
        b = self.backend
        out = None
        for r0 in range(0, self.rows, self.piece_rows):
            n = min(self.piece_rows, self.rows - r0)
            piece = b.matrix(self._read(r0, n), self.ggml_type, (n, self.k), self.name)
            y = np.asarray(b.to_numpy(b.matmul(piece, x)), np.float32)
            if out is None:
                out = np.empty((y.shape[0], self.rows), np.float32)
            out[:, r0:r0 + n] = y
        return out


def embed(backend: Any, table: Any, ids: np.ndarray) -> Any:
    """backend.embed(table, ids), also when the table is left on storage."""
    return table.embed(ids) if isinstance(table, StreamedMatrix) else backend.embed(table, ids)
