"""Every sequence's block table kept as a row of one host array, updated as blocks come and go.

vLLM keeps its running requests' block tables in a persistent array that each step only
updates (its ``InputBatch`` / ``BlockTable``) instead of building the tables again from
Python lists. Here the block manager, the one place that changes a block table, writes each
change into :class:`BlockTableArray` too: a sequence that holds blocks owns a row
(``Sequence.table_row``), entry ``i`` of which is ``block_table[i]`` and the rest -1, and the
same row of a twin array padded with the table's last block instead (the C++ decode kernel's
and the CUDA graphs' form). A decode step then takes its sequences' tables with one gather of
their rows in each (:meth:`BlockTableArray.gather`) instead of a pass over 256 Python lists
that the step's forward has pushed out of the CPU's caches (about 0.2 ms a step at 256
sequences on a 2-core EPYC) and six array operations for the second padding.

The lists stay the sequences' own record (every other reader uses them); the array mirrors
them exactly, which the tests check after every kind of change.
"""

from __future__ import annotations

import operator

import numpy as np

from dfllm.engine.sequence import Sequence

_TABLE_ROW = operator.attrgetter("table_row")


class BlockTableArray:
    """Block tables as rows of an int32 array padded with -1 (``array``), one row per sequence
    holding blocks, and the same rows padded with each table's own last block instead
    (``own``: what :meth:`~dfllm.engine.step_inputs.DecodeArrays.own_tables` makes); both grow
    (rows and columns doubled) as needed."""

    def __init__(self, rows: int = 64, width: int = 16):
        self.array = np.full((rows, width), -1, dtype=np.int32)
        self.own = np.full((rows, width), -1, dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int64)  # each row's table length
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first

    def _row(self, seq: Sequence) -> int:
        """``seq``'s row, given one if it has none."""
        if seq.table_row < 0:
            if not self._free_rows:
                self._grow_rows()
            seq.table_row = self._free_rows.pop()
        return seq.table_row

    def _grow_rows(self) -> None:
        rows, width = self.array.shape
        empty = np.full((rows, width), -1, dtype=np.int32)
        self.array, self.own = np.concatenate([self.array, empty]), np.concatenate([self.own, empty])
        self.lengths = np.concatenate([self.lengths, np.zeros(rows, dtype=np.int64)])
        self._free_rows = list(range(2 * rows - 1, rows - 1, -1))

    def _grow_columns(self) -> None:
        self.array = np.concatenate([self.array, np.full(self.array.shape, -1, dtype=np.int32)], axis=1)
        self.own = np.concatenate([self.own, np.repeat(self.own[:, -1:], self.own.shape[1], axis=1)], axis=1)

    def append(self, seq: Sequence, block_id: int) -> None:
        """``block_id`` was appended to ``seq.block_table``."""
        row = self._row(seq)
        at = int(self.lengths[row])
        if at >= self.array.shape[1]:
            self._grow_columns()
        self.array[row, at] = block_id
        self.own[row, at:] = block_id  # the new last block pads the rest
        self.lengths[row] = at + 1

    def set(self, seq: Sequence, index: int, block_id: int) -> None:
        """Entry ``index`` of ``seq.block_table`` became ``block_id`` (a released block's
        ``FREED``)."""
        row = seq.table_row
        self.array[row, index] = block_id
        if index == self.lengths[row] - 1:  # the last block: the padding too
            self.own[row, index:] = block_id
        else:
            self.own[row, index] = block_id

    def release(self, seq: Sequence) -> None:
        """``seq`` holds no blocks any more: its row is cleared and free for another."""
        row = seq.table_row
        if row < 0:
            return
        self.array[row, : self.lengths[row]] = -1
        self.own[row] = -1
        self.lengths[row] = 0
        self._free_rows.append(row)
        seq.table_row = -1

    def gather(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The block tables of ``seqs`` (each holding blocks) as :func:`~dfllm.engine.step_inputs.pad_tables`
        gives them (an int32 ``[n, width]`` array padded with -1 to the longest, and their
        lengths) and padded with each one's own last block instead (between the two)."""
        rows = np.fromiter(map(_TABLE_ROW, seqs), np.int64, len(seqs))
        lens = self.lengths[rows]
        width = int(lens.max())
        return self.array[rows, :width], self.own[rows, :width], lens

    def table(self, seq: Sequence) -> list[int]:
        """``seq``'s row as a list (what ``seq.block_table`` holds, when the two agree)."""
        if seq.table_row < 0:
            return []
        return self.array[seq.table_row, : self.lengths[seq.table_row]].tolist()
