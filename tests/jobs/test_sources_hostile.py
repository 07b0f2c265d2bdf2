"""Hostile input files for ``dfllm run``'s readers (CSV, JSON Lines) and ``dfllm run-batch``'s
(compressed batch files): every row comes out exactly once with every value it holds, or
the file is refused with an error naming it and its line, before anything is written.

The properties call the readers directly (real files, no model); one ``dfllm run`` goes
through the command's entry point on a real cluster, and the run-batch checks run
``run_batch``/``dry_run_batch`` on the tiny random Llama (refused before any engine starts).
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import re
import zipfile
from pathlib import Path

import dask
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dfllm.jobs.batch_job import dry_run_batch, run_batch
from dfllm.jobs.cli import main as cli_main
from dfllm.jobs.sources import InputError, read_input

pytestmark = pytest.mark.timeout(600)

PROPERTY = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
BOM = b"\xef\xbb\xbf"
#: single bytes that never start valid UTF-8 (continuation bytes, overlong and out-of-range leads)
BAD_BYTES = st.binary(min_size=1, max_size=3).map(
    lambda b: bytes(0x80 + x % 0x42 if x % 2 else 0xF5 + x % 0x0B for x in b)
)
#: CSV cells pandas reads as the text written (never a number, boolean or null)
WORDS = st.text(st.characters(categories=["L"]), max_size=6).map(lambda t: "w" + t)


def read(path: Path) -> pd.DataFrame:
    with dask.config.set(scheduler="synchronous"):
        return read_input(str(path)).compute()


def plain(series: pd.Series) -> list:
    return [None if pd.isna(v) else v for v in series.astype(object)]


def escaped(data: bytes) -> str:
    """``data`` as the readers read bytes that are not UTF-8: each as its ``\\xNN`` escape."""
    return data.decode("utf-8", "backslashreplace")


# ---- S1: CSV rows with more fields than the header ------------------------------------------------------
@PROPERTY
@given(
    header=st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=3, unique=True),
    rows=st.lists(st.tuples(st.lists(WORDS, min_size=3, max_size=3), st.integers(0, 2)), min_size=1, max_size=6),
    bom=st.booleans(),
)
def test_csv_rows_with_more_fields_than_the_header_are_refused_naming_the_line(tmp_path_factory, header, rows, bom):
    """Before the fix, a file whose every row had one field more than the header read as
    nulls in every column (pandas took the first field for the index), and the job ran."""
    path = tmp_path_factory.mktemp("csv") / "in.csv"
    lines = [",".join(header)]
    first_extra = None
    for number, (words, extra) in enumerate(rows, 2):
        lines.append(",".join((words * 3)[: len(header) + extra]))
        if extra and first_extra is None:
            first_extra = number
    path.write_bytes((BOM if bom else b"") + ("\n".join(lines) + "\n").encode())
    if first_extra is None:
        got = read(path)
        assert list(got.columns) == header and len(got) == len(rows)
        for i, name in enumerate(header):  # every value, as written
            assert plain(got[name]) == [(words * 3)[i] for words, _ in rows]
        return
    with pytest.raises(InputError) as caught:
        read(path)
    message = str(caught.value)
    extra_lines = [n for n, (_, extra) in enumerate(rows, 2) if extra]  # pandas names a later one, if first
    assert str(path) in message and any(re.search(rf"\bline {n}\b", message) for n in extra_lines), message


def test_cli_refuses_a_csv_whose_rows_have_an_extra_field(tiny_llama, tmp_path, capsys):
    """Before the fix: exit 0, every row's ``llm_error`` "column 'q' is null", the values lost."""
    src = tmp_path / "in.csv"
    src.write_text("q\nfirst,1\nsecond,2\n")
    argv = ["run", str(src), str(tmp_path / "out"), "--prompt", "Q: {q}", "--model", str(tiny_llama)]
    try:
        status = cli_main(argv)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    assert status == 1 and str(src) in err and "line 2 has 2 fields" in err, err
    assert not (tmp_path / "out").exists()


# ---- S2: JSON Lines with a BOM, bytes that are not UTF-8, huge integers, deep nesting --------------------
JSON_ROWS = st.lists(
    st.tuples(
        st.text(min_size=0, max_size=6),  # the text before a run of bad bytes
        st.one_of(st.none(), BAD_BYTES),
        st.text(min_size=0, max_size=6),
        st.one_of(
            st.integers(-(2**63), 2**63 - 1),
            st.integers(2**64, 2**80),
            st.integers(4301, 5000).map(lambda d: int("7" * 4000) * 10 ** (d - 4000) + 3),
        ),
    ),
    min_size=1,
    max_size=6,
)


@PROPERTY
@given(rows=JSON_ROWS, bom=st.booleans())
def test_jsonl_every_line_once_with_every_value(tmp_path_factory, rows, bom):
    """Before the fix, a BOM, one invalid byte or one integer of more than 4,300 digits
    refused the whole file (the byte naming no line)."""
    path = tmp_path_factory.mktemp("jsonl") / "in.jsonl"
    data, want_q, want_n = [], [], []
    for before, bad, after, n in rows:
        q = json.dumps(before)[1:-1].encode() + (bad or b"") + json.dumps(after)[1:-1].encode()
        with_digits = str(n) if abs(n) < 10**4000 else None
        digits = (with_digits or _digits(n)).encode()
        data.append(b'{"q": "' + q + b'", "n": ' + digits + b"}\n")
        want_q.append(
            before.encode("utf-8", "backslashreplace").decode()
            + escaped(bad or b"")
            + after.encode("utf-8", "backslashreplace").decode()
        )
        want_n.append(digits.decode())
    path.write_bytes((BOM if bom else b"") + b"".join(data))
    got = read(path)
    assert list(got.columns) == ["q", "n"] and len(got) == len(rows)
    assert plain(got["q"]) == want_q
    if all(-(2**63) <= n < 2**63 for *_, n in rows):
        assert plain(got["n"]) == [int(n) for n in want_n]
    else:  # an integer beyond 64 bits: the field is JSON text in every row
        assert plain(got["n"]) == want_n


def _digits(n: int) -> str:
    """The decimal digits of an integer past Python's limit on converting it to text."""
    import sys

    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return str(n)
    finally:
        sys.set_int_max_str_digits(limit)


@pytest.mark.parametrize(
    "line, why",
    [
        (b'{"q": "b", "z": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests"),
        (b'{"q": "b", "z": ' + b"{" + b'"a": {' * 50_000 + b"}" * 50_001 + b"}", "nests"),
        (b'{"q": "b"} \xff', "not valid JSON"),  # an invalid byte outside any string: not JSON
        (b'{"q": ', "not valid JSON"),
        (b"[1, 2]", "not an object"),
    ],
)
def test_a_jsonl_line_that_cannot_be_read_is_refused_naming_file_and_line(tmp_path, line, why):
    """Before the fix, deep nesting raised RecursionError naming neither file nor line."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(BOM + b'{"q": "a"}\n\n' + line + b'\n{"q": "c"}\n')
    with pytest.raises(InputError) as caught:
        read_input(str(path))
    message = str(caught.value)
    assert str(path) in message and "line 3 " in message and why in message, message


@pytest.mark.slow
def test_cli_jsonl_with_bom_bad_bytes_and_huge_integers_runs(cli_cluster, tiny_llama, tmp_path, capsys):
    """Before the fix: exit 1, the whole file refused (BOM, then the invalid byte, then the integer)."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(BOM + b'{"q": "a", "n": 1}\n{"q": "b\xff", "n": 2}\n{"q": "c", "n": ' + b"9" * 5000 + b"}\n")
    argv = [
        *("run", str(src), str(tmp_path / "out"), "--prompt", "Q: {q} {n}", "--model", str(tiny_llama)),
        *("--max-tokens", "2", "--max-model-len", "64", "--no-progress", "--scheduler", cli_cluster.address),
    ]
    try:
        status = cli_main(argv)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    assert status == 0, err
    got = pd.read_parquet(tmp_path / "out")
    assert got["q"].tolist() == ["a", "b\\xff", "c"] and got["n"].tolist() == ["1", "2", "9" * 5000]
    errors = got["llm_error"].tolist()
    assert pd.isna(errors[0]) and pd.isna(errors[1]) and "longer" in errors[2], errors  # 5,000 digits: past the context


# ---- S4: run-batch on a compressed file that is not in its extension's format ----------------------------
LINE = json.dumps(
    {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}}
).encode()
COMPRESS = {
    "gz": gzip.compress,
    "bz2": bz2.compress,
    "xz": lzma.compress,
    "zip": lambda data: _zip({"in.jsonl": data}),
}


def _zip(members: dict[str, bytes]) -> bytes:
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buffer.getvalue()


@settings(PROPERTY, max_examples=12)
@given(ext=st.sampled_from(sorted(COMPRESS)), how=st.sampled_from(["plain", "truncated", "garbage"]))
def test_run_batch_refuses_a_file_not_in_its_compression_before_writing(tiny_llama, tmp_path_factory, ext, how):
    """Before the fix: ``BadGzipFile: Not a gzipped file``, ``EOFError``, ``OSError: Invalid
    data stream``, ``BadZipFile`` naming no file, and ``out.jsonl.parts/_dfllm_keys/`` left behind."""
    root = tmp_path_factory.mktemp("rb")
    data = (LINE + b"\n") * 200
    body = {
        "plain": data,
        "truncated": COMPRESS[ext](data)[:-24],
        "garbage": b"\x00\x01not compressed at all\n" * 3,
    }[how]
    src = root / f"in.jsonl.{ext}"
    src.write_bytes(body)
    kwargs = dict(model=str(tiny_llama), max_model_len=64, kv_cache_memory_bytes=2**22)
    for attempt in ("dry", "real"):
        with pytest.raises(ValueError) as caught:
            if attempt == "dry":
                dry_run_batch(str(src), output_file=str(root / "out.jsonl"), sample_rows=0, **kwargs)
            else:
                run_batch(str(src), str(root / "out.jsonl"), progress=False, **kwargs)
        assert str(src) in str(caught.value), str(caught.value)
        assert sorted(p.name for p in root.iterdir()) == [src.name]  # nothing created


def test_run_batch_refuses_a_zip_of_several_files(tiny_llama, tmp_path):
    """Before the fix, only the zip's first file was read: the other's lines had no answer."""
    src = tmp_path / "in.jsonl.zip"
    src.write_bytes(_zip({"a.jsonl": LINE + b"\n", "b.jsonl": LINE + b"\n"}))
    with pytest.raises(ValueError, match="2 files"):
        run_batch(str(src), str(tmp_path / "out.jsonl"), model=str(tiny_llama), max_model_len=64, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_run_batch_reads_a_compressed_file_in_its_format(tiny_llama, tmp_path):
    for ext, compress in COMPRESS.items():
        src = tmp_path / f"in.jsonl.{ext}"
        src.write_bytes(compress(BOM + (LINE + b"\n") * 3))
        report = dry_run_batch(str(src), model=str(tiny_llama), sample_rows=0, max_model_len=64)
        assert report.rows == 3 and report.refused == 0, ext


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
@pytest.mark.parametrize("prompt", [None, "Q: {q} {r}"])
def test_cli_an_empty_jsonl_input_is_a_success(tiny_llama, tmp_path, capsys, content, prompt):
    """A JSON Lines file without a line has no row and no field: the job is the success an
    empty input is (exit 0, an empty output with the columns the job reads), as a CSV with
    only its header is; it failed naming the columns the frame lacked."""
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    argv = ["run", str(src), str(tmp_path / "out"), "--model", str(tiny_llama), "--max-tokens", "2"]
    argv += ["--prompt", prompt] if prompt else []
    try:
        status = cli_main(argv)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    assert status == 0, capsys.readouterr().err
    out = pd.read_parquet(tmp_path / "out")
    assert len(out) == 0
    assert {"q", "r"} <= set(out.columns) if prompt else "prompt" in out.columns
