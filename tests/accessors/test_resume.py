"""``write_parquet(resume=True)`` is exact: whatever an earlier write's partitioning, row
order or task, the folder ends with one part per partition of this write and every input
row read back exactly once; the summary counts what a reader reads.

On a real LocalCluster with worker processes and a tiny random Llama.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dask.dataframe as dd
import pandas as pd
import pyarrow.parquet as pq
import pytest

import dfllm

from helpers import local_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

N = 4


@pytest.fixture(scope="module")
def client():
    with local_client(workers=2, threads=1) as c:
        yield c


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    return pd.DataFrame({"id": range(N), "q": [f"Tell me about river number {w}." for w in "abcd"]})


@pytest.fixture
def write(client, tiny_llama):
    """``write(df, out, npartitions, resume=..., max_tokens=..., sort=...)``: one write_parquet."""

    def run(
        df: pd.DataFrame, out: Path, npartitions: int, *, resume: bool = True, max_tokens: int = 2, sort: bool = True
    ) -> dfllm.WriteSummary:
        ddf = dd.from_pandas(df, npartitions=npartitions, sort=sort)
        assert ddf.npartitions == npartitions
        result = ddf.llm.generate(
            "{q}",
            model=str(tiny_llama),
            max_model_len=64,
            kv_cache_memory_bytes=2**22,
            sampling_params={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        )
        return dfllm.write_parquet(result, str(out), resume=resume, progress=False)

    return run


def exact(out: Path, summary: dfllm.WriteSummary, ids: range = range(N)) -> pd.DataFrame:
    """Every row once, the summary equal to what a reader reads, nothing stale left."""
    back = pd.read_parquet(out)
    assert summary.rows == len(back) == len(ids)
    assert sorted(back["id"]) == list(ids)
    assert sorted(p.name for p in out.glob("part.*")) == [f"part.{i:05d}.parquet" for i in range(summary.partitions)]
    assert sorted(p.name for p in (out / "_dfllm_keys").iterdir()) == [
        f"part.{i:05d}.key" for i in range(summary.partitions)
    ]
    assert not list(out.rglob(".tmp-*"))
    assert summary.written + summary.skipped == summary.partitions
    return back


@pytest.mark.parametrize("before, after", [(4, 2), (2, 4), (3, 1), (1, 3)])
def test_resume_with_other_partitions_reads_every_row_once(write, rows, tmp_path, before, after):
    out = tmp_path / "out"
    first = write(rows, out, before, resume=False)
    exact(out, first)
    again = write(rows, out, after)
    back = exact(out, again)
    assert back["generated_text"].notna().all() and (back["num_generated_tokens"] == 2).all()
    third = write(rows, out, after)  # and a resume of that run keeps everything
    assert (third.written, third.skipped) == (0, after)
    exact(out, third)


def test_shuffled_rows(write, rows, tmp_path):
    out = tmp_path / "out"
    exact(out, write(rows, out, 4, resume=False))
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("part.*")}
    shuffled = rows.sample(frac=1, random_state=3)
    assert shuffled["id"].tolist() != rows["id"].tolist()
    # the same one-row partitions in another order: parts are reused under their new numbers
    moved = write(shuffled, out, 4, sort=False)
    assert (moved.written, moved.skipped) == (0, 4)
    exact(out, moved)
    # by row order, part.i holds the rows of partition i of this write
    for i, row_id in enumerate(shuffled["id"]):
        assert pd.read_parquet(out / f"part.{i:05d}.parquet")["id"].tolist() == [row_id]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part.*")} != mtimes
    # other pairs of rows than any earlier partition: recomputed, each row once
    exact(out, write(shuffled, out, 2, sort=False))


def test_partitions_shifted_by_new_input(write, rows, tmp_path):
    """New input ahead of the old (a file added to the input folder): every old partition
    moves up one number and is reused, only the new one is computed."""
    out = tmp_path / "out"
    exact(out, write(rows.iloc[1:], out, 3, resume=False), ids=range(1, N))
    shifted = write(rows, out, 4)
    assert (shifted.written, shifted.skipped) == (1, 3)
    exact(out, shifted)
    assert not (out / "_dfllm_keys" / "set-aside").exists()


def test_changed_task(write, rows, tmp_path):
    out = tmp_path / "out"
    exact(out, write(rows, out, 4, resume=False, max_tokens=2))
    changed = write(rows, out, 2, max_tokens=3)
    assert (changed.written, changed.skipped) == (2, 0)
    back = exact(out, changed)
    assert (back["num_generated_tokens"] == 3).all()
    same_parts = write(rows, out, 2, max_tokens=2)
    assert same_parts.written == 2
    assert (exact(out, same_parts)["num_generated_tokens"] == 2).all()


def test_stale_temporary_and_leftover_files(write, rows, tmp_path):
    """dfllm's own leftovers (a part and key of a crashed run with more partitions, its
    temporary files, its set-aside parts) are removed; nothing else is."""
    out = tmp_path / "out"
    exact(out, write(rows, out, 2, resume=False))
    shutil.copy(out / "part.00001.parquet", out / "part.00007.parquet")  # dfllm's footer: dfllm's part
    (out / "_dfllm_keys" / "part.00007.key").write_text('{"key": "0"}')
    (out / ".tmp-0123abcd-part.00001.parquet").write_bytes(b"PAR1 half a file")
    (out / "_dfllm_keys" / ".tmp-0123abcd-part.00001.key").write_text("{")
    (out / "_dfllm_keys" / "part.00001.key").write_text("null")  # valid JSON, not a record: recompute
    (out / "_notes.txt").write_text("mine")  # hidden from readers: left alone
    again = write(rows, out, 2)
    assert (again.written, again.skipped) == (1, 1)
    exact(out, again)
    assert (out / "_notes.txt").read_text() == "mine"


def test_records_nested_past_pythons_limit_are_no_records(write, rows, tmp_path):
    """A key record or a part's footer record nested deeper than Python reads is not a
    record, and its part is recomputed (a RecursionError failed the write)."""
    out = tmp_path / "out"
    exact(out, write(rows, out, 2, resume=False))
    deep = "[" * 100_000 + "]" * 100_000
    (out / "_dfllm_keys" / "part.00000.key").write_text(deep)
    again = write(rows, out, 2)
    assert (again.written, again.skipped) == (1, 1)
    exact(out, again)
    table = pq.read_table(out / "part.00001.parquet")
    mine = table.replace_schema_metadata({**table.schema.metadata, b"dfllm": deep.encode()})
    pq.write_table(mine, out / "part.00001.parquet")
    last = write(rows, out, 2)
    assert (last.written, last.skipped) == (1, 1)
    exact(out, last)


@pytest.mark.parametrize("name", ["part.0.parquet", "part.00003.parquet", "_metadata"])
def test_files_dfllm_did_not_write_are_refused_not_deleted(write, rows, tmp_path, name):
    """Another tool's parts (Dask's ``part.0.parquet``, a part without dfllm's footer) and a
    ``_metadata`` dfllm did not write are never deleted: the write is refused before any work."""
    out = tmp_path / "out"
    exact(out, write(rows, out, 2, resume=False))
    rows.iloc[:1].to_parquet(out / name)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    for resume in (False, True):
        with pytest.raises(ValueError, match=rf"1 file\(s\) that dfllm did not write \({name}\)"):
            write(rows, out, 2, resume=resume)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_part_replaced_before_its_key_is_recomputed(write, rows, tmp_path):
    """A crash between moving a part into place and recording its key leaves a new part
    beside the key of the old one: the part's footer tells them apart."""
    out, other = tmp_path / "out", tmp_path / "other"
    exact(out, write(rows, out, 2, resume=False))
    others = rows.assign(id=rows["id"] + 100, q=[f"Something else {w}." for w in "wxyz"])
    write(others, other, 2, resume=False)
    shutil.copy(other / "part.00000.parquet", out / "part.00000.parquet")
    again = write(rows, out, 2)
    assert (again.written, again.skipped) == (1, 1)
    exact(out, again)
    record = pq.read_metadata(out / "part.00000.parquet").metadata[b"dfllm"]
    assert (out / "_dfllm_keys" / "part.00000.key").read_bytes() == record


@pytest.mark.parametrize("keep", [0, 0.5])
def test_a_part_cut_short_after_it_was_written_is_recomputed(write, rows, tmp_path, keep):
    """A part dfllm wrote that later lost its end (no footer left to read: a copy cut short, a
    full disk) is still dfllm's by its key record, and is recomputed; a file without a
    readable footer and without that record stays another tool's file (above)."""
    out = tmp_path / "out"
    exact(out, write(rows, out, 2, resume=False))
    part = out / "part.00001.parquet"
    part.write_bytes(part.read_bytes()[: int(len(part.read_bytes()) * keep)])
    again = write(rows, out, 2)
    assert (again.written, again.skipped) == (1, 1)
    exact(out, again)
    (out / "_dfllm_keys" / "part.00001.key").unlink()
    part.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"1 file\(s\) that dfllm did not write \(part.00001.parquet\)"):
        write(rows, out, 2)
    assert part.read_bytes() == b"not parquet"


def test_folder_with_other_files_is_refused_before_any_work(write, rows, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    rows.to_parquet(out / "input.parquet")
    with pytest.raises(ValueError, match=r"1 file\(s\) that dfllm did not write \(input.parquet\)"):
        write(rows, out, 2, resume=False)
    assert [p.name for p in out.iterdir()] == ["input.parquet"]
