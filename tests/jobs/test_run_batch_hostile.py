"""``dfllm run-batch`` on hostile input and a hostile output folder.

- The staging folder ``<output>.parts/`` is the job's own: refused when it holds anything
  a batch job did not write, refused as the home of the input or the error file, and at the
  end only the files the job wrote are removed.
- A chat template that raises, does not parse or reads an undefined variable, a lone
  surrogate in any string (``custom_id`` included), an integer of more digits than Python
  reads, a bad ``top_logprobs`` or grammar: each is that line's 400 naming its field, in the
  real run and in ``--dry-run``.
- A UTF-8 byte-order mark at the start of the file (PowerShell 5, Excel) is dropped; one
  anywhere else is that line's error, under the line's custom_id. A file that starts with a
  UTF-16 or UTF-32 byte-order mark (PowerShell 5's ``>``) is refused before any work.
- A partition with no line (the blocks after the first of a line longer than
  ``partition_bytes``, a file of a byte-order mark alone) is read by the dry run too.
- A property test feeds generated hostile lines and checks that the job completes, every
  line comes out exactly once in place, every error names its line (and its field), and
  nothing outside the job's files appears or disappears in the output folder.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dfllm.jobs.batch_job import _remove_staging, dry_run_batch, run_batch

from run_batch_data import ENGINE, chat, check_line, line, write_jsonl

pytestmark = pytest.mark.timeout(600)
HUGE = "9" * 5000  # more digits than Python's int-string limit (4300)


def run(model: Path, src: Path, out: Path, **kwargs):
    return run_batch(str(src), str(out), model=str(model), progress=False, **ENGINE, **kwargs)


def dry(model: Path, src: Path) -> dict[str, str]:
    """The dry run's refusals: label (custom_id, else ``line N``) -> message."""
    report = dry_run_batch(str(src), model=str(model), sample_rows=0, **ENGINE)
    return {label: message for r in report.refusals for label, message in r.examples}


def read_jsonl(path: Path) -> list[dict]:
    """JSON Lines split at ``\\n`` only: a JSON string may hold U+0085 or U+2028 as they are,
    which ``str.splitlines`` would take for line ends."""
    return [json.loads(t) for t in path.read_text(encoding="utf-8").split("\n") if t]


def by_id(path: Path) -> dict:
    rows = read_jsonl(path)
    for r in rows:
        check_line(r)
    return {r["custom_id"]: r for r in rows}


# ---- the staging folder -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_staging_folder_is_the_jobs_own(tiny_llama, tmp_path):
    """An input or error file inside ``<output>.parts/`` and a user's file there (a ``.keep``,
    which parquet readers skip) are refused before any work, and kept; a resumed run reuses
    what the killed one wrote; at the end the job removes only the files it wrote."""
    out = tmp_path / "out.jsonl"
    staging = tmp_path / "out.jsonl.parts"
    (staging / "_in").mkdir(parents=True)
    inside = write_jsonl(staging / "_in" / "in.jsonl", [chat("a", "Hi")])
    with pytest.raises(ValueError, match="inside the staging folder"):
        run(tiny_llama, inside, out)
    assert inside.exists()
    src = write_jsonl(tmp_path / "in.jsonl", [chat("a", "Hi"), chat("b", "Hello")])
    inside.unlink()
    (staging / "_in").rmdir()
    with pytest.raises(ValueError, match="inside the staging folder"):
        run(tiny_llama, src, out, error_file=str(staging / "_errors.jsonl"))
    keep = staging / ".keep"
    keep.write_text("mine")
    with pytest.raises(ValueError, match=r"holds 1 file\(s\) that no batch job wrote \(.keep\)"):
        run(tiny_llama, src, out)
    assert keep.read_text() == "mine" and not out.exists()
    keep.unlink()
    staging.rmdir()

    first = run(tiny_llama, src, out, keep_parts=True, partition_bytes=100)  # as a killed run leaves it
    assert first.partitions >= 2 and staging.is_dir()
    again = run(tiny_llama, src, out, resume=True, partition_bytes=100)
    assert (again.skipped, again.written) == (first.partitions, 0) and not staging.exists()
    assert [r["custom_id"] for r in read_jsonl(out)] == ["a", "b"]

    run(tiny_llama, src, out, keep_parts=True, partition_bytes=100)
    notes = staging / "_dfllm_keys" / "notes.txt"  # put there while the job ran
    notes.write_text("mine")
    _remove_staging(str(staging), None, first.partitions)
    assert notes.read_text() == "mine"
    assert sorted(str(p.relative_to(staging)) for p in staging.rglob("*")) == ["_dfllm_keys", "_dfllm_keys/notes.txt"]


# ---- lines that fail in the template, the tokenizer or the JSON reader ------------------------------------
def test_chat_templates_that_fail_are_their_lines_400(tiny_llama, tmp_path):
    rows = [
        chat("raises", "Hi", chat_template="{{ raise_exception('Conversation roles must alternate') }}"),
        chat("syntax", "Hi", chat_template="{% if %}"),
        chat("undefined", "Hi", chat_template="{{ foo.bar }}"),
        chat("kwargs", "Hi", chat_template_kwargs={"messages": []}),
        chat("good", "Hi"),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = run(tiny_llama, src, tmp_path / "out.jsonl")
    got = by_id(tmp_path / "out.jsonl")
    assert (summary.lines, summary.failed) == (5, 4) and got["good"]["error"] is None
    want = {
        "raises": ("body.chat_template", "Conversation roles must alternate"),
        "syntax": ("body.chat_template", "TemplateSyntaxError"),
        "undefined": ("body.chat_template", "'foo' is undefined"),
        "kwargs": ("body.chat_template_kwargs.messages", "chat template's own argument"),
    }
    refused = dry(tiny_llama, src)
    assert sorted(refused) == sorted(want)
    for cid, (param, words) in want.items():
        error = got[cid]["error"]
        assert got[cid]["response"]["status_code"] == 400 and error["param"] == param, error
        assert words in error["message"] and words in refused[cid], (error, refused[cid])


def test_lone_surrogates_are_their_lines_400_naming_the_field(tiny_llama, tmp_path):
    """``"\\ud83d"`` is valid JSON but not Unicode text: in any string of a line it is that
    line's 400 naming the field; a custom_id holding one is reported with it escaped."""
    rows = [
        chat("chat", "Hi \ud83d there"),
        chat("a\ud83db", "Hi"),
        line("prompt", "/v1/completions", prompt=["ok", "x\udc00"], max_tokens=2),
        chat("stop", "Hi", stop=["\ud800"]),
        line("emb", "/v1/embeddings", input="\udfff"),
        chat("good", "Hi"),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)  # json.dumps writes the surrogates as \ud83d escapes
    assert "\\ud83d" in src.read_text()
    summary = run(tiny_llama, src, tmp_path / "out.jsonl")
    got = by_id(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "out.jsonl")] == [
        "chat",
        "a\\ud83db",
        "prompt",
        "stop",
        "emb",
        "good",
    ]
    assert (summary.lines, summary.failed) == (6, 5)
    want = {
        "chat": "body.messages[0].content",
        "a\\ud83db": "custom_id",
        "prompt": "body.prompt[1]",
        "stop": "body.stop[0]",
        "emb": "body.input",
    }
    refused = dry(tiny_llama, src)
    assert sorted(refused) == sorted(want)
    for cid, param in want.items():
        error = got[cid]["error"]
        assert got[cid]["response"]["status_code"] == 400 and error["param"] == param, error
        assert "lone surrogate" in error["message"] and "lone surrogate" in refused[cid]


def test_an_integer_of_too_many_digits_is_its_lines_400(tiny_llama, tmp_path):
    big = json.dumps(chat("big", "Hi", max_completion_tokens=0)).replace(
        '"max_completion_tokens": 0', f'"max_completion_tokens": {HUGE}'
    )
    # the last line is that integer alone: not the JSON object a line must be (invalid_json)
    src = write_jsonl(tmp_path / "in.jsonl", [big, f"[{HUGE}]", chat("good", "Hi"), HUGE])
    summary = run(tiny_llama, src, tmp_path / "out.jsonl")
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in rows] == ["big", None, "good", None] and (summary.lines, summary.failed) == (4, 3)
    assert rows[0]["error"]["param"] == "body.max_completion_tokens" and "5,000 digits" in rows[0]["error"]["message"]
    assert rows[1]["error"]["param"] == "[0]" and rows[1]["error"]["line"] == 2
    assert rows[3]["error"]["code"] == "invalid_json" and rows[3]["error"]["param"] is None
    assert "must be a JSON object" in rows[3]["error"]["message"] and "5,000 digits" in rows[3]["error"]["message"]
    assert sorted(dry(tiny_llama, src)) == ["big", "line 2", "line 4"]


def test_the_engines_errors_name_the_field_that_asked(tiny_llama, tmp_path):
    rows = [
        chat("top", "Hi", logprobs=True, top_logprobs=50),  # above the engine's max_logprobs (20)
        chat("grammar", "Hi", guided_grammar='root ::= "a" undefined_rule'),
        chat("structured", "Hi", structured_outputs={"grammar": "root ::= ("}),
        line("completion", "/v1/completions", prompt="Hi", max_tokens=2, guided_grammar="root ::= nope"),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    run(tiny_llama, src, tmp_path / "out.jsonl")
    got = by_id(tmp_path / "out.jsonl")
    want = {
        "top": "body.top_logprobs",
        "grammar": "body.guided_grammar",
        "structured": "body.structured_outputs",
        "completion": "body.guided_grammar",
    }
    assert {cid: got[cid]["error"]["param"] for cid in want} == want


def test_huge_values_are_cut_in_messages_and_the_custom_id_is_kept_whole(tiny_llama, tmp_path):
    """A ``custom_id``, ``method``, ``url``, field name or field value of any size is shown in
    its line's error, and a ``custom_id`` in the dry run's report, cut at
    :data:`~dfllm.errors.MAX_SHOWN` characters (before: whole, a line of megabytes);
    the answer's own ``custom_id`` is the input's, whole (users join on it)."""
    big = 300_000
    long_id, answered_id = "c" * big, "d" * big
    body = chat("x", "Hi")["body"]
    rows = [
        {**chat("x", "Hi"), "custom_id": list(range(50_000))},
        {**chat(long_id, "Hi"), "method": "G" * big},
        {**chat("url-list", "Hi"), "url": [0] * 50_000},
        {**chat("url-text", "Hi"), "url": "/v1/" + "u" * big},
        line("role", messages=[{"role": "r" * big, "content": "Hi"}]),
        chat("format", "Hi", response_format=list(range(50_000))),
        {**chat("field", "Hi"), "body": {**body, "f" * big: 1}},
        chat(answered_id, "Hi"),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = run(tiny_llama, src, tmp_path / "out.jsonl")
    got = read_jsonl(tmp_path / "out.jsonl")
    ids = [None, long_id, "url-list", "url-text", "role", "format", "field", answered_id]
    assert [r["custom_id"] for r in got] == ids and (summary.lines, summary.failed) == (8, 7)
    for r in got[:-1]:
        check_line(r)
        assert len(r["error"]["message"]) < 1_000, (r["custom_id"][:20] if r["custom_id"] else None, r["error"])
    assert got[-1]["error"] is None
    report = dry_run_batch(str(src), model=str(tiny_llama), sample_rows=0, **ENGINE)
    assert long_id in {label for r in report.refusals for label, _ in r.examples}  # the label itself is whole
    assert report.longest_row == answered_id
    assert max(len(text) for text in report.format().splitlines()) < 1_000


@pytest.mark.parametrize("gz", [False, True])
def test_a_byte_order_mark_at_the_start_of_the_file_is_dropped(tiny_llama, tmp_path, gz):
    text = "\ufeff" + json.dumps(chat("first", "Hi")) + "\n\ufeff" + json.dumps(chat("second", "Hi")) + "\n"
    src = tmp_path / ("in.jsonl.gz" if gz else "in.jsonl")
    src.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    summary = run(tiny_llama, src, tmp_path / "out.jsonl")
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert (summary.lines, summary.failed) == (2, 1)
    assert rows[0]["custom_id"] == "first" and rows[0]["error"] is None
    assert rows[1]["error"]["line"] == 2 and "BOM" in rows[1]["error"]["message"]


def test_a_byte_order_mark_inside_the_file_is_its_lines_error_under_its_custom_id(tiny_llama, tmp_path):
    """The line after a BOM is otherwise a request: its error answer and the dry run name
    its custom_id (they had none for it: null, and ``line 2``)."""
    text = json.dumps(chat("first", "Hi")) + "\n\ufeff" + json.dumps(chat("second", "Hi")) + "\n"
    src = tmp_path / "in.jsonl"
    src.write_bytes(text.encode())
    run(tiny_llama, src, tmp_path / "out.jsonl")
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in rows] == ["first", "second"]
    assert rows[1]["error"]["line"] == 2 and "BOM" in rows[1]["error"]["message"]
    assert list(dry(tiny_llama, src)) == ["second"]


@pytest.mark.parametrize(
    "encoding, gz",
    [("UTF-16 LE", False), ("UTF-16 LE", True), ("UTF-16 BE", False), ("UTF-32 LE", False), ("UTF-32 BE", False)],
)
def test_a_utf16_or_utf32_file_is_refused_before_any_work(tiny_llama, tmp_path, encoding, gz):
    """PowerShell 5's ``>`` writes UTF-16 (LE, with its byte-order mark): split at ``\\n``
    bytes its lines were each answered "not valid UTF-8" or "not valid JSON", one more than
    the file has; now the job and the dry run refuse the file, naming its encoding, and
    write nothing."""
    text = "\ufeff" + "".join(json.dumps(chat(c, "Hi")) + "\r\n" for c in ("a", "b"))
    data = text.encode(encoding.replace(" ", "-").lower())  # utf-16-le...: the mark is the text's own
    src = tmp_path / ("in.jsonl.gz" if gz else "in.jsonl")
    src.write_bytes(gzip.compress(data) if gz else data)
    out = tmp_path / "out.jsonl"
    for call in (lambda: run(tiny_llama, src, out), lambda: dry(tiny_llama, src)):
        with pytest.raises(ValueError, match=f"is {encoding} text .* save it as UTF-8"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_the_dry_run_reads_partitions_that_hold_no_line(tiny_llama, tmp_path):
    """A line longer than ``partition_bytes`` (1 MiB by default: a long document, an image)
    leaves each block after its first with no line, and a file of a byte-order mark alone
    is one block with none: the dry run failed on such a partition (``KeyError: 'block'``),
    which the real run reads."""
    src = write_jsonl(tmp_path / "in.jsonl", [chat("long", "Hi " * 40), chat("short", "Hi")])
    report = dry_run_batch(str(src), model=str(tiny_llama), sample_rows=0, partition_bytes=64, **ENGINE)
    assert (report.rows, report.accepted, report.refused) == (2, 2, 0) and report.partitions > 2
    summary = run(tiny_llama, src, tmp_path / "out.jsonl", partition_bytes=64)
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["long", "short"]
    assert (summary.lines, summary.failed) == (2, 0)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes("\ufeff".encode())
    assert dry_run_batch(str(bom), model=str(tiny_llama), sample_rows=0, **ENGINE).rows == 0


# ---- the property: hostile lines ---------------------------------------------------------------------------
ODD = st.sampled_from(["\ud83d", "a\udc00b", "\ufeff", "\x00", "\u202e", "é𝄞", "", " ", "\n", "{{"])
TEXT = st.one_of(*[st.text(max_size=6)] * 4, ODD)  # odd strings one time in five
NUMBER = (
    st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -1, 1, 2**31, 2**63, 10**40, "__HUGE__"])
    | st.floats(allow_nan=False, allow_infinity=False)
)
VALUE = st.recursive(
    st.none() | st.booleans() | NUMBER | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
TEMPLATES = st.sampled_from(
    ["{{ raise_exception('roles must alternate') }}", "{% if %}", "{{ foo.bar }}", "{{ messages[0]['content'] }}"]
)
BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/embeddings": {"input": "Hi"},
}
FIELDS = [
    "messages",
    "prompt",
    "input",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "response_format",
    "structured_outputs",
    "guided_regex",
    "guided_choice",
    "chat_template",
    "chat_template_kwargs",
    "echo",
    "stream",
    "min_tokens",
    "stop_token_ids",
    "allowed_token_ids",
    "truncate_prompt_tokens",
    "encoding_format",
    "dimensions",
    "user",
]


@st.composite
def hostile_line(draw) -> str:
    kind = draw(st.sampled_from(["request", "request", "request", "not-an-object", "text"]))
    if kind == "not-an-object":
        return json.dumps(draw(VALUE)).replace('"__HUGE__"', HUGE)
    if kind == "text":
        return draw(st.sampled_from(["{not json", "\ufeff{}", "[1, 2", "nul", '"\\ud83d"', "{}"]))

    def rarely(usual, odd):  # mostly a usable value, so that most lines reach their body's checks
        return draw(odd) if draw(st.integers(0, 9)) == 0 else draw(usual)

    url = rarely(st.sampled_from(list(BODIES)), st.sampled_from(["/v1/responses", None]) | VALUE)
    body = json.loads(json.dumps(BODIES.get(url, {}) if isinstance(url, str) else {}))
    for _ in range(draw(st.integers(0, 3))):
        name = rarely(st.sampled_from(FIELDS), TEXT)
        body[name] = draw(TEMPLATES if name == "chat_template" else VALUE)
    if "messages" in body and draw(st.booleans()):  # a message field of any type
        body["messages"] = [
            {"role": rarely(st.sampled_from(["user", "system", "assistant"]), VALUE), "content": draw(VALUE)}
        ]
    row: dict = {"method": rarely(st.just("POST"), VALUE), "url": url, "body": body}
    # duplicates, odd Unicode, wrong types
    row["custom_id"] = rarely(st.sampled_from(["a", "a", "b", "b", "c", "d\ud83d"]), VALUE)
    if draw(st.integers(0, 9)) == 0:
        row.pop(draw(st.sampled_from(list(row))))
    if draw(st.integers(0, 9)) == 0:
        row["body"] = draw(VALUE)
    return json.dumps(row).replace('"__HUGE__"', HUGE)


def expected_custom_id(text: str):
    """What the answer line's custom_id must be: a string custom_id, surrogates escaped; else null."""
    try:
        row = json.loads(text, parse_int=float)  # float reads any number of digits
    except ValueError:
        return None
    cid = row.get("custom_id") if isinstance(row, dict) else None
    return cid.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(cid, str) else None


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile")


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lines=st.lists(hostile_line(), min_size=1, max_size=6),
    blank=st.booleans(),
    error_file=st.booleans(),
)
def test_hostile_lines_each_get_one_answer_in_place(tiny_llama, folder, lines, blank, error_file):
    """Whatever the lines hold, the job completes; each non-blank line has exactly one answer
    (the output in input order, or the output and the error file), under its custom_id; each
    error names its line (and its field, unless the line is not a JSON object); nothing but
    the job's files appears or disappears in the folder; the dry run refuses exactly the
    lines the job fails."""
    for p in folder.iterdir():  # the previous example's files (a folder only after a failed run)
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (folder / ".keep").write_text("mine")
    (folder / "_notes").write_text("mine")
    texts = lines + ([""] if blank else []) + [json.dumps(chat("last", "Hi"))]
    src = folder / "in.jsonl"
    src.write_text("".join(t + "\n" for t in texts))
    before = sorted(p.name for p in folder.iterdir())
    out, err = folder / "out.jsonl", folder / "err.jsonl"
    summary = run(tiny_llama, src, out, error_file=str(err) if error_file else None)
    after = sorted(p.name for p in folder.iterdir())
    assert after == sorted(before + ["out.jsonl"] + (["err.jsonl"] if error_file else []))
    assert (folder / ".keep").read_text() == "mine" and (folder / "_notes").read_text() == "mine"

    answers = read_jsonl(out) + (read_jsonl(err) if error_file else [])
    numbered = [(n, t) for n, t in enumerate(texts, 1) if t.strip()]
    assert len(answers) == len(numbered) == summary.lines
    failed = [a for a in answers if a["error"] is not None]
    assert len(failed) == summary.failed
    ok_lines = [(n, t) for n, t in numbered if n not in {a["error"]["line"] for a in failed}]
    assert len(ok_lines) + len(failed) == len(numbered)
    if not error_file:  # in input order
        assert [a["custom_id"] for a in answers] == [expected_custom_id(t) for _, t in numbered]
    assert [a["custom_id"] for a in answers if a["error"] is None] == [expected_custom_id(t) for _, t in ok_lines]
    for a in failed:
        check_line(a)
        e, n = a["error"], a["error"]["line"]
        assert a["custom_id"] == expected_custom_id(texts[n - 1]), (a, texts[n - 1])
        assert e["message"].startswith(f"line {n}: ") and a["response"]["status_code"] in (400, 404, 405), e
        assert "cannot be read" not in e["message"] and "engine failed" not in e["message"], e
        assert e["param"] is not None or e["code"] == "invalid_json", e

    report = dry_run_batch(str(src), model=str(tiny_llama), sample_rows=0, **ENGINE)
    assert report.rows == len(numbered) and report.refused == summary.failed
    assert sorted(p.name for p in folder.iterdir()) == after
