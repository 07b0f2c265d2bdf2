"""Beam search on the dataframe accessors (issue #52): ``sampling_params=BeamSearchParams(...)``
on ``.llm.generate``/``.llm.chat`` (pandas, Polars, and Dask on a real cluster of worker
processes) puts the best beam's continuation in the output column and every beam in ``beams``;
``json_schema`` constrains every beam; a resumed write and the response cache never mix a beam
search's answers with a sampled one's."""

from __future__ import annotations

import json

import dask.dataframe as dd
import jsonschema
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import LLM, BeamSearchParams
from dfllm.beam_search import beam_search_score
from dfllm.tasks.schema import BEAM_TYPE, BEAMS

from helpers import local_client

pytestmark = pytest.mark.timeout(600)

ENGINE = {"max_model_len": 64, "kv_cache_memory_bytes": 2**22}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["calm", "glad", "sad"]}},
    "required": ["ok", "mood"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def kw(tiny_llama):
    return dict(model=str(tiny_llama), **ENGINE)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **ENGINE)


@pytest.fixture(scope="module")
def frame():
    return pd.DataFrame({"id": range(5), "q": ["What is 2+2?", None, "Name a colour.", "x " * 200, "Why?"]})


def expected_beams(llm, prompt: str, params: BeamSearchParams) -> list[dict]:
    """What the ``beams`` column should hold for one prompt: LLM.beam_search's beams, best first."""
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    ids = tok.encode(prompt)
    out = []
    for s in llm.beam_search([{"prompt_token_ids": ids}], params)[0].sequences:
        generated = s.tokens[len(ids) :]
        ended = bool(generated) and generated[-1] == eos and not params.ignore_eos
        out.append(
            {
                "text": tok.decode(generated[:-1] if ended else generated, skip_special_tokens=True),
                "score": beam_search_score(s.tokens, s.cum_logprob, eos, params.length_penalty),
                "cumulative_logprob": s.cum_logprob,
                "finish_reason": "stop" if ended else "length",
            }
        )
    return out


def check_rows(out: pd.DataFrame, frame: pd.DataFrame, llm, params: BeamSearchParams) -> None:
    for q, text, beams, error in zip(frame["q"], out["generated_text"], out[BEAMS], out["llm_error"]):
        if not isinstance(q, str) or len(q) > 300:
            continue
        if not pd.isna(error):  # too long for the context: its own error, like a sampled row's
            assert text is None or pd.isna(text)
            continue
        want = expected_beams(llm, q, params)
        assert [b["text"] for b in beams] == [b["text"] for b in want]
        assert [b["finish_reason"] for b in beams] == [b["finish_reason"] for b in want]
        assert [b["score"] for b in beams] == pytest.approx([b["score"] for b in want], abs=1e-4)
        assert text == beams[0]["text"]  # the best beam's continuation


@pytest.mark.slow
@pytest.mark.parametrize("width,max_tokens,penalty", [(1, 4, 1.0), (3, 5, 0.5)])
def test_pandas_generate_best_beam_and_every_beam(kw, llm, frame, width, max_tokens, penalty):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty)
    out = frame.llm.generate("q", sampling_params=params, **kw)
    assert list(out.columns) == [
        "id",
        "q",
        "generated_text",
        "num_input_tokens",
        "num_generated_tokens",
        "finish_reason",
        BEAMS,
        "llm_error",
    ]
    assert out[BEAMS].dtype == pd.ArrowDtype(pa.list_(BEAM_TYPE))
    assert out["generated_text"].dtype == pd.ArrowDtype(pa.string())
    assert out["llm_error"].isna().tolist() == [True, False, True, False, True]
    check_rows(out, frame, llm, params)
    for beams in out[BEAMS].dropna():
        scores = [b["score"] for b in beams]
        assert len(beams) == width and scores == sorted(scores, reverse=True)


@pytest.mark.slow
def test_json_schema_constrains_every_beam(kw):
    frame = pd.DataFrame({"q": ["A reply:", "Tell me how you feel."]})
    params = BeamSearchParams(beam_width=2, max_tokens=40)
    out = frame.llm.generate("q", sampling_params=params, json_schema=SCHEMA, logprobs_mode="processed_logprobs", **kw)
    assert out["llm_error"].isna().all()
    assert out["generated_text"].dtype == pd.ArrowDtype(pa.struct([("ok", pa.bool_()), ("mood", pa.string())]))
    for value, beams in zip(out["generated_text"], out[BEAMS]):
        assert len(beams) == 2
        for b in beams:
            assert b["finish_reason"] == "stop"
            jsonschema.validate(json.loads(b["text"]), SCHEMA)
        assert value == json.loads(beams[0]["text"])  # the typed column: the best beam's value


def test_chat_and_polars(kw, llm):
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    frame = pd.DataFrame({"q": ["Hi there", "Tell me more"]})
    chat = frame.llm.chat("{q}", sampling_params=params, **kw)
    assert chat["llm_error"].isna().all() and all(len(b) == 2 for b in chat[BEAMS])
    assert chat["generated_text"].tolist() == [b[0]["text"] for b in chat[BEAMS]]
    out = pl.DataFrame({"q": ["Hi there", None, "Tell me more"]}).llm.generate("q", sampling_params=params, **kw)
    assert out.schema[BEAMS] == pl.List(
        pl.Struct(
            {"text": pl.String, "score": pl.Float64, "cumulative_logprob": pl.Float64, "finish_reason": pl.String}
        )
    )
    pandas_out = pd.DataFrame({"q": ["Hi there", None, "Tell me more"]}).llm.generate("q", sampling_params=params, **kw)
    assert out["generated_text"].to_list() == [None if pd.isna(t) else t for t in pandas_out["generated_text"]]


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 3), st.integers(1, 4), st.sampled_from([0.5, 1.0, 2.0]))
def test_beams_match_llm_beam_search(kw, llm, width, max_tokens, penalty):
    frame = pd.DataFrame({"q": ["Name a colour.", "Why?"]})
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty)
    check_rows(frame.llm.generate("q", sampling_params=params, **kw), frame, llm, params)


def test_call_time_checks(kw, frame):
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    from dfllm.tasks.task import make_task

    with pytest.raises(ValueError, match="takes no sampling_params"):
        make_task("embed", ("q",), ["q"], output_column="e", sampling_params=params, model_check=lambda t: None)
    with pytest.raises(ValueError, match="does not take images"):
        frame.assign(img=None).llm.generate("q", sampling_params=params, images="img", **kw)
    with pytest.raises(ValueError, match="already exist"):
        frame.assign(beams=1).llm.generate("q", sampling_params=params, **kw)
    from dfllm.structured_outputs import StructuredOutputsParams

    with pytest.raises(ValueError, match="once"):
        frame.llm.generate(
            "q",
            sampling_params=BeamSearchParams(2, 3, structured_outputs=StructuredOutputsParams(choice=["a"])),
            json_schema=SCHEMA,
            **kw,
        )


def test_beam_and_sampled_jobs_share_no_cached_answers(kw, tmp_path):
    """A beam search and a greedy sampled task of the same prompts: their tasks' keys differ
    (a resumed write recomputes), and the beam rows are never answered from the response
    cache the sampled rows filled."""
    frame = pd.DataFrame({"q": ["Name a colour.", "Why?"]})
    cache = tmp_path / "cache"
    greedy = frame.llm.generate(
        "q", sampling_params={"temperature": 0, "max_tokens": 4}, cache=cache, engine_columns="from_cache", **kw
    )
    beam = frame.llm.generate(
        "q", sampling_params=BeamSearchParams(2, 4), cache=cache, engine_columns="from_cache", **kw
    )
    assert not beam["from_cache"].any() and not greedy["from_cache"].any()
    again = frame.llm.generate(
        "q", sampling_params=BeamSearchParams(2, 4), cache=cache, engine_columns="from_cache", **kw
    )
    pd.testing.assert_frame_equal(beam.drop(columns=["from_cache"]), again.drop(columns=["from_cache"]))
    from dfllm.tasks.task import make_task
    from dfllm.tasks.write_key import canonical

    def key(sampling_params) -> str:
        task = make_task(
            "generate",
            ("q",),
            ["q"],
            output_column="generated_text",
            model=kw["model"],
            sampling_params=sampling_params,
            model_check=lambda t: None,
        )
        return canonical(task)

    keys = {key({"temperature": 0, "max_tokens": 4}), key(BeamSearchParams(2, 4)), key(BeamSearchParams(3, 4))}
    keys |= {key(BeamSearchParams(2, 4, length_penalty=0.5)), key(BeamSearchParams(2, 4, ignore_eos=True))}
    assert len(keys) == 5


# ---- Dask on a real cluster of worker processes ------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    with local_client(workers=2, threads=1) as c:
        yield c


@pytest.mark.slow
def test_dask_generate_and_resumed_write(client, kw, llm, frame, tmp_path):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    ddf = dd.from_pandas(frame, npartitions=2)
    result = ddf.llm.generate("q", sampling_params=params, **kw)
    computed = result.compute()
    assert result._meta.dtypes.to_dict() == computed.dtypes.to_dict()
    expected = frame.llm.generate("q", sampling_params=params, **kw)
    # the input's string column comes back as Dask's string dtype; the output columns' dtypes must match
    pd.testing.assert_frame_equal(computed.reset_index(drop=True), expected.reset_index(drop=True), check_dtype=False)
    out_cols = [c for c in expected.columns if c not in frame.columns]
    assert computed[out_cols].dtypes.astype(str).tolist() == expected[out_cols].dtypes.astype(str).tolist()
    check_rows(computed, frame, llm, params)
    path = str(tmp_path / "answers")
    first = dfllm.write_parquet(result, path, progress=False)
    assert first.written == 2
    same = dfllm.write_parquet(ddf.llm.generate("q", sampling_params=params, **kw), path, resume=True, progress=False)
    assert (same.written, same.skipped) == (0, 2)
    wider = BeamSearchParams(beam_width=3, max_tokens=4)
    changed = dfllm.write_parquet(ddf.llm.generate("q", sampling_params=wider, **kw), path, resume=True, progress=False)
    assert changed.written == 2  # other beam settings recompute
    back = pd.read_parquet(path)
    assert sorted(back["id"].tolist()) == list(range(5))
    assert all(len(b) == 3 for b, e in zip(back[BEAMS], back["llm_error"]) if pd.isna(e))
