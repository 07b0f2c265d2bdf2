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
    (rows and columns doubled) as needed.

    Appended blocks are written in one go before the arrays are next read (``array``,
    ``own``, ``lengths``, :meth:`gather`, :meth:`table`) or otherwise changed: a step in which
    256 sequences each take a block (they cross a block boundary together) costs a few array
    operations instead of four element writes a sequence."""

    def __init__(self, rows: int = 64, width: int = 16):
        self._array = np.full((rows, width), -1, dtype=np.int32)
        self._own = np.full((rows, width), -1, dtype=np.int32)
        self._lengths = np.zeros(rows, dtype=np.int64)  # each row's table length, as written
        self._lens = [0] * rows  # each row's table length, appends not yet written included
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first
        # appends not yet written: (row, column, block id) each
        self._pending_rows: list[int] = []
        self._pending_cols: list[int] = []
        self._pending_ids: list[int] = []

    @property
    def array(self) -> np.ndarray:
        self._write_pending()
        return self._array

    @property
    def own(self) -> np.ndarray:
        self._write_pending()
        return self._own

    @property
    def lengths(self) -> np.ndarray:
        self._write_pending()
        return self._lengths

    def _row(self, seq: Sequence) -> int:
        """``seq``'s row, given one if it has none."""
        if seq.table_row < 0:
            if not self._free_rows:
                self._grow_rows()
            seq.table_row = self._free_rows.pop()
        return seq.table_row

    def _grow_rows(self) -> None:
        self._write_pending()
        rows, width = self._array.shape
        empty = np.full((rows, width), -1, dtype=np.int32)
        self._array, self._own = np.concatenate([self._array, empty]), np.concatenate([self._own, empty])
        self._lengths = np.concatenate([self._lengths, np.zeros(rows, dtype=np.int64)])
        self._lens += [0] * rows
        self._free_rows = list(range(2 * rows - 1, rows - 1, -1))

    def _grow_columns(self, width: int) -> None:
        """Columns doubled until there are at least ``width``."""
        while self._array.shape[1] < width:
            self._array = np.concatenate([self._array, np.full(self._array.shape, -1, dtype=np.int32)], axis=1)
            self._own = np.concatenate([self._own, np.repeat(self._own[:, -1:], self._own.shape[1], axis=1)], axis=1)

    def append(self, seq: Sequence, block_id: int) -> None:
        """``block_id`` was appended to ``seq.block_table`` (written before the next read)."""
        row = self._row(seq)
        at = self._lens[row]
        self._lens[row] = at + 1
        self._pending_rows.append(row)
        self._pending_cols.append(at)
        self._pending_ids.append(block_id)

    def _write_pending(self) -> None:
        """Write the appends not yet written: the blocks into ``array``, the rows' new lengths,
        and those rows of ``own`` made again from ``array`` (each padded with its last block)."""
        if not self._pending_rows:
            return
        rows = np.array(self._pending_rows, dtype=np.int64)
        cols = np.array(self._pending_cols, dtype=np.int64)
        ids = self._pending_ids
        self._pending_rows, self._pending_cols, self._pending_ids = [], [], []
        self._grow_columns(int(cols.max()) + 1)
        self._array[rows, cols] = ids
        np.maximum.at(self._lengths, rows, cols + 1)
        # a row that took several blocks is made several times over, the same each time
        lens = self._lengths[rows]
        tables = self._array[rows]
        last = tables[np.arange(len(rows)), lens - 1]
        self._own[rows] = np.where(np.arange(tables.shape[1]) < lens[:, None], tables, last[:, None])

    def set(self, seq: Sequence, index: int, block_id: int) -> None:
        """Entry ``index`` of ``seq.block_table`` became ``block_id`` (a released block's
        ``FREED``)."""
        self._write_pending()
        row = seq.table_row
        self._array[row, index] = block_id
        if index == self._lengths[row] - 1:  # the last block: the padding too
            self._own[row, index:] = block_id
        else:
            self._own[row, index] = block_id

    def release(self, seq: Sequence) -> None:
        """``seq`` holds no blocks any more: its row is cleared and free for another."""
        row = seq.table_row
        if row < 0:
            return
        self._write_pending()
        self._array[row, : self._lengths[row]] = -1
        self._own[row] = -1
        self._lengths[row] = 0
        self._lens[row] = 0
        self._free_rows.append(row)
        seq.table_row = -1

    def gather(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The block tables of ``seqs`` (each holding blocks) as :func:`~dfllm.engine.step_inputs.pad_tables`
        gives them (an int32 ``[n, width]`` array padded with -1 to the longest, and their
        lengths) and padded with each one's own last block instead (between the two)."""
        self._write_pending()
        rows = np.fromiter(map(_TABLE_ROW, seqs), np.int64, len(seqs))
        lens = self._lengths[rows]
        width = int(lens.max())
        return self._array[rows, :width], self._own[rows, :width], lens

    def table(self, seq: Sequence) -> list[int]:
        """``seq``'s row as a list (what ``seq.block_table`` holds, when the two agree)."""
        if seq.table_row < 0:
            return []
        self._write_pending()
        return self._array[seq.table_row, : self._lengths[seq.table_row]].tolist()
