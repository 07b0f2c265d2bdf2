"""Hostile input is normal input, for ``dfllm run``'s sources (CSV, JSON Lines, parquet), its
dry run and ``build_processor``: every input row comes out exactly once, with its answer or
an error naming what was wrong, and nothing crashes the job.

The properties run ``dfllm run`` through its entry point in this process against a real
cluster (``dask scheduler``/``dask worker``), few examples each, on the tiny random Llama.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import dask.dataframe as dd
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dfllm
from dfllm.jobs.cli import main as cli_main
from dfllm.jobs.processor import RowFailedError
from dfllm.jobs.sources import read_input

pytestmark = pytest.mark.timeout(900)

SP = dict(temperature=0.0, max_tokens=2, ignore_eos=True)
ENGINE = {"max_model_len": 64, "kv_cache_memory_bytes": 2**22}
#: the columns ``dfllm run --task generate`` writes: an input column of these names is refused
OUTPUT_COLUMNS = ("generated_text", "num_input_tokens", "num_generated_tokens", "finish_reason", "llm_error")
PROPERTY = settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        status = cli_main(argv)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    return status, capsys.readouterr().err


def job_argv(src: Path, out: Path, model: Path, address: str, *extra: str) -> list[str]:
    return [
        "run",
        str(src),
        str(out),
        "--prompt",
        "Q: {q}",
        "--model",
        str(model),
        "--max-tokens",
        "2",
        "--max-model-len",
        "64",
        "--max-error-rate",
        "1",
        "--no-progress",
        "--scheduler",
        address,
        *extra,
    ]


def plain(series: pd.Series) -> list:
    """The values, nulls as None (an Arrow-backed null is ``pd.NA``, which does not compare)."""
    return [None if pd.isna(v) else v for v in series.astype(object)]


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


# ---- 9: CSV files whose column types differ -------------------------------------------------------------
def test_csv_files_whose_column_types_differ_are_unified_up_front(tmp_path):
    """Failed before the fix: "Mismatched dtypes found in pd.read_csv" at compute time."""
    (tmp_path / "in").mkdir()
    pd.DataFrame({"id": [1, 2], "q": ["a", "b"], "n": [1, 2]}).to_csv(tmp_path / "in" / "1.csv", index=False)
    pd.DataFrame({"id": ["x7", "007"], "q": ["c", "d"], "n": [0.5, None]}).to_csv(
        tmp_path / "in" / "2.csv", index=False
    )
    (tmp_path / "in" / "3.csv").write_bytes(b"q,extra\n\xff bad bytes,1\n")  # no id, a new column, not UTF-8
    ddf = read_input(str(tmp_path / "in"))
    got = ddf.compute()
    assert list(got.columns) == ["id", "q", "n", "extra"]
    assert got["id"].tolist()[:4] == ["1", "2", "x7", "007"] and pd.isna(got["id"].iloc[4])  # text, as written
    assert str(got["id"].dtype) == str(ddf.dtypes["id"]) == "string"
    assert got["n"].dtype == "float64" and got["n"].tolist()[:3] == [1.0, 2.0, 0.5]
    assert got["q"].iloc[4] == "\\xff bad bytes"


@pytest.mark.slow
def test_cli_csv_folder_with_differing_types_runs(cli_cluster, tiny_llama, tmp_path, capsys):
    (tmp_path / "in").mkdir()
    pd.DataFrame({"id": [1, 2], "q": ["a", "b"]}).to_csv(tmp_path / "in" / "1.csv", index=False)
    pd.DataFrame({"id": ["x", "y"], "q": ["c", "d"]}).to_csv(tmp_path / "in" / "2.csv", index=False)
    status, err = run_cli(job_argv(tmp_path / "in", tmp_path / "out", tiny_llama, cli_cluster.address), capsys)
    assert status == 0, err
    got = pd.read_parquet(tmp_path / "out")
    assert sorted(got["id"]) == ["1", "2", "x", "y"] and got["llm_error"].isna().all()


# ---- 8: JSON Lines values that do not fit the type of their field ---------------------------------------
def test_jsonl_values_that_do_not_fit_their_field_are_read_as_json_text(tmp_path):
    """Failed before the fix: ArrowInvalid (a list mixing kinds), OverflowError (an integer
    beyond int64), UnicodeEncodeError (a lone surrogate), naming no column, file or line."""
    lines = [
        {"q": "a", "tags": [1, 2], "n": 1, "s": "ok"},
        {"q": "b", "tags": [2, "x"], "n": 2**70, "s": "\ud800"},
        {"q": "c", "tags": None, "n": None, "s": None},
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = read_input(str(tmp_path / "a.jsonl")).compute()
    assert got["tags"].tolist()[:2] == ["[1, 2]", '[2, "x"]'] and pd.isna(got["tags"].iloc[2])
    assert got["n"].tolist()[:2] == ["1", str(2**70)]
    assert got["s"].tolist()[:2] == ["ok", "\\ud800"]


@pytest.mark.slow
def test_cli_jsonl_with_values_that_do_not_fit(cli_cluster, tiny_llama, tmp_path, capsys):
    """Failed before the fix: exit 1 with ``ArrowInvalid ...``."""
    lines = [{"q": "a", "tags": [1, 2]}, {"q": "b", "tags": [2, "x"]}, {"q": "c", "big": 2**70}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    status, err = run_cli(job_argv(tmp_path / "a.jsonl", tmp_path / "out", tiny_llama, cli_cluster.address), capsys)
    assert status == 0, err
    got = pd.read_parquet(tmp_path / "out")
    assert got["q"].tolist() == ["a", "b", "c"] and got["llm_error"].isna().all()
    assert got["tags"].tolist()[:2] == ["[1, 2]", '[2, "x"]'] and got["big"].iloc[2] == str(2**70)


# ---- 2: chained processors keep upstream failures -------------------------------------------------------
def _stage(tiny_llama, **config):
    cfg = dfllm.ProcessorConfig(model_source=str(tiny_llama), engine_kwargs=ENGINE, batch_size=4, **config)
    seen: list = []

    def pre(row):
        seen.append(row["id"])
        return dict(prompt=f"say {row['q']}", sampling_params=SP)

    def post(row):
        return dict(id=row["id"], q=row["q"], answer=row["generated_text"])

    return dfllm.build_processor(cfg, preprocess=pre, postprocess=post), seen


def test_a_row_failed_upstream_keeps_its_error_and_skips_the_engine(tiny_llama):
    """Failed before the fix: row 1 was prompted with "say None" and came out with an
    answer and no error."""
    stage1, _ = _stage(tiny_llama)
    df = pd.DataFrame({"id": range(4), "q": ["sky", "word " * 80, "sea", "tree"]})
    first = stage1(df)
    assert first["llm_error"].notna().tolist() == [False, True, False, False]
    earlier = first.loc[1, "llm_error"]
    second = first.drop(columns=["answer"]).assign(q=lambda d: d["q"].where(d["llm_error"].isna(), None))
    stage2, seen = _stage(tiny_llama)
    out = stage2(second)
    assert plain(out["llm_error"])[1] == earlier and pd.isna(out.loc[1, "answer"])
    assert seen == [0, 2, 3]  # the failed row reached neither preprocess nor the engine
    assert out["llm_error"].isna().tolist() == [True, False, True, True] and out["answer"].notna().sum() == 3


def test_upstream_error_column_follows_should_continue_on_error(tiny_llama):
    df = pd.DataFrame({"id": [0, 1], "q": ["a", "b"], "__inference_error__": [None, "stage 1: boom"]})
    stage, seen = _stage(tiny_llama, should_continue_on_error=True)
    out = stage(df)
    assert plain(out["__inference_error__"]) == [None, "stage 1: boom"] and seen == [0]
    strict, _ = _stage(tiny_llama, should_continue_on_error=False)
    with pytest.raises(RowFailedError, match="stage 1: boom"):
        strict(df.rename(columns={"__inference_error__": "llm_error"}))


def test_dask_chain_samples_past_rows_failed_upstream(tiny_llama):
    from distributed import Client, LocalCluster

    df = pd.DataFrame({"id": range(6), "q": list("abcdef"), "llm_error": ["x", "y", None, None, None, None]})
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        with Client(cluster):
            stage, _ = _stage(tiny_llama)
            stage.sample_rows = 2
            got = stage(dd.from_pandas(df, npartitions=3)).compute()
    assert plain(got["llm_error"])[:2] == ["x", "y"] and got["answer"].iloc[2:].notna().all()


odd_values = st.one_of(
    st.none(),
    st.floats(allow_nan=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=8),
    st.sampled_from(["", " ", "\x00", "\u202e", "a\udfffb", "word " * 40]),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@PROPERTY
@given(
    st.lists(
        st.tuples(odd_values, st.one_of(st.none(), st.sampled_from(["", "earlier failure", "\ud800"]))),
        min_size=1,
        max_size=6,
    )
)
def test_processor_property_every_row_once_with_its_answer_or_error(tiny_llama, rows):
    """Any prompt value, any incoming ``llm_error``: every row comes out once, in order; a row
    with an incoming error keeps exactly it and runs nothing; every other row has its answer
    or an error."""
    df = pd.DataFrame(
        {
            "id": range(len(rows)),
            "p": pd.Series([p for p, _ in rows], dtype=object),
            "llm_error": pd.Series([e for _, e in rows], dtype=object),
        }
    )
    seen: list = []

    def pre(row):
        seen.append(row["id"])
        return dict(prompt=row["p"], sampling_params=SP)

    cfg = dfllm.ProcessorConfig(model_source=str(tiny_llama), engine_kwargs=ENGINE, batch_size=4)
    out = dfllm.build_processor(cfg, preprocess=pre)(df)
    assert out["id"].tolist() == list(range(len(rows)))
    for i, (_, earlier) in enumerate(rows):
        # every row failing, the output has no generated_text (its columns come from the rows)
        answer = plain(out["generated_text"])[i] if "generated_text" in out else None
        error = plain(out["llm_error"])[i]
        if earlier is not None:
            # its earlier message first (a lone surrogate as its escape), then any value of its
            # own that does not fit the output's column (as the semantic operators' "earlier; new")
            kept = earlier.encode("utf-8", "backslashreplace").decode()
            assert error == kept or error.startswith(kept + "; column 'p'"), error
            assert i not in seen and answer is None
        else:
            assert i in seen
            assert (answer is not None) != (error is not None), out.iloc[i]


# ---- 5: a dry run refuses the rows whose LoRA adapter cannot run ----------------------------------------
@pytest.mark.slow
def test_dry_run_refuses_rows_whose_adapter_cannot_run(cli_cluster, tiny_llama, tmp_path):
    """Failed before the fix: 0 refused against 2 ``llm_error``s (the dry run resolved the
    adapters but never ran the engine's check)."""
    from dfllm.jobs.dry_run import dry_run

    from helpers import make_adapter

    root = tmp_path / "adapters"
    make_adapter(tiny_llama, root / "small", 1, 4, ["q_proj", "v_proj"])
    make_adapter(tiny_llama, root / "wide", 2, 16, ["q_proj", "v_proj"])
    df = pd.DataFrame({"q": ["a", "b", "c", "d"], "adapter": ["small", "missing", "wide", None]})
    client = cli_cluster.client()

    def job(ddf):
        return ddf.llm.generate(
            "{q}",
            model=str(tiny_llama),
            lora="adapter",
            lora_root=str(root),
            max_lora_rank=8,
            max_model_len=64,
            sampling_params=SP,
        )

    with client.as_current():
        ddf = dd.from_pandas(df, npartitions=2)
        report = dry_run(job(ddf), output=str(tmp_path / "out"), sample_rows=2, calibration_seconds=5)
        real = job(ddf).compute()
    failed = real[real["llm_error"].notna()]
    assert sorted(failed.index) == [1, 2]
    assert report.refused == 2 and report.accepted == 2
    examples = {row: message for r in report.refusals for row, message in r.examples}
    assert examples == dict(zip(failed.index, failed["llm_error"]))
    assert "max_lora_rank" in examples[2]


# ---- the class: any source, any values ------------------------------------------------------------------
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**80), max_value=2**80),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=6),
        st.sampled_from(["", "\ud800", "a\udfffb", "\u202e\u200b", "\x00", "line\nbreak", 'quote"', "é😀"]),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
column_names = st.sampled_from(["q", "id", "x", "", " ", "a,b", "é", "q.1", "Unnamed: 0", *OUTPUT_COLUMNS])


@st.composite
def tables(draw):
    """(column names, possibly empty or repeated or clashing, and rows of values of any type);
    column ``rid`` numbers the rows and ``q`` (the prompt's) is always there."""
    names = ["rid", "q", *draw(st.lists(column_names, max_size=3))]
    n = draw(st.integers(min_value=1, max_value=4))
    rows = [[i, *(draw(json_values) for _ in names[1:])] for i in range(n)]
    return names, rows


def write_jsonl(path: Path, names: list[str], rows: list[list]) -> None:
    lines = []
    for row in rows:  # written by hand: a repeated key is in the file twice (the last one counts)
        lines.append("{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in zip(names, row)) + "}")
    path.write_text("\n".join(lines) + "\n")


def write_csv(path: Path, names: list[str], rows: list[list]) -> None:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(names)
    for row in rows:
        w.writerow(["" if v is None else v if isinstance(v, str) else json.dumps(v) for v in row])
    path.write_bytes(buf.getvalue().encode("utf-8", "surrogatepass"))  # a lone surrogate: bytes that are no UTF-8


def write_parquet(path: Path, names: list[str], rows: list[list]) -> None:
    def clean(v):  # Arrow's text is UTF-8: a lone surrogate cannot be in a parquet file
        if isinstance(v, str):
            return v.encode("utf-8", "backslashreplace").decode()
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {clean(k): clean(x) for k, x in v.items()}
        return v

    arrays = []
    for j in range(len(names)):
        values = [clean(r[j]) for r in rows]
        try:
            arrays.append(pa.array(values))
        except (pa.ArrowException, TypeError, ValueError, OverflowError):  # no one type: as JSON text
            arrays.append(pa.array([None if v is None else json.dumps(v) for v in values], pa.string()))
    for j, array in enumerate(arrays):  # a type parquet cannot hold (a struct without fields): as JSON text
        try:
            pq.write_table(pa.table({"x": array}), io.BytesIO())
        except (pa.ArrowException, TypeError, ValueError):
            arrays[j] = pa.array([None if r[j] is None else json.dumps(clean(r[j])) for r in rows], pa.string())
    pq.write_table(pa.Table.from_arrays(arrays, names=names), path)


WRITERS = {"jsonl": write_jsonl, "csv": write_csv, "parquet": write_parquet}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(WRITERS))
def test_cli_property_every_row_once_with_its_answer_or_its_error(cli_cluster, tiny_llama, tmp_path_factory, fmt):
    capsys_free = _Capture()

    @PROPERTY
    @given(tables())
    def check(table):
        names, rows = table
        root = tmp_path_factory.mktemp(fmt)
        src = root / f"in.{fmt}"
        WRITERS[fmt](src, names, rows)
        (root / "bystander.txt").write_text("not the job's")
        before = files_under(root)
        out = root / "out"
        with capsys_free as cap:
            status = _status(job_argv(src, out, tiny_llama, cli_cluster.address))
        stderr = cap.err
        after = files_under(root)
        assert before <= after, f"removed: {before - after}"
        assert all(f.startswith("out/") for f in after - before), after - before
        if set(_read_names(src, fmt, names)) & set(OUTPUT_COLUMNS):
            # refused before anything runs, naming the column (the output would overwrite it)
            assert status == 1 and "already exist" in stderr and not out.exists(), stderr
            return
        if fmt == "parquet" and len(set(names)) < len(names):
            assert status == 1 and "more than one column named" in stderr and not out.exists(), stderr
            return
        assert status in (0, 3), stderr[-2000:]
        got = pq.read_table(out).to_pandas(ignore_metadata=True, types_mapper=pd.ArrowDtype)
        assert sorted(got["rid"].tolist()) == list(range(len(rows)))  # every row once
        for _, row in got.iterrows():
            answered, error = pd.notna(row["generated_text"]), row["llm_error"]
            assert answered or pd.notna(error), row
            if pd.notna(error):  # it names what was wrong: a column
                assert "column" in error or "prompt" in error, error

    check()


def _read_names(src: Path, fmt: str, names: list[str]) -> list[str]:
    """The column names the job sees (pandas names a CSV's empty and repeated headers)."""
    if fmt == "csv":
        return [str(c) for c in pd.read_csv(src, nrows=0, encoding_errors="backslashreplace").columns]
    return names


def _status(argv: list[str]) -> int:
    try:
        return cli_main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


class _Capture:
    """stderr of the block (pytest's capsys is per test; the property runs many examples in one)."""

    def __enter__(self):
        import contextlib

        self.err = ""
        self._buf = io.StringIO()
        self._ctx = contextlib.redirect_stderr(self._buf)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self.err = self._buf.getvalue()
        return False
