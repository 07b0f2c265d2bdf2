"""Beam search in ``dfllm run-batch`` (issue #52): ``use_beam_search: true`` in a
``/v1/completions`` or ``/v1/chat/completions`` body is answered with vLLM's OpenAI-server
semantics (``n`` the beam width, ``n`` choices best first, the continuation's text without the
end-of-sequence token), through the job's own engine; the fields beam search cannot honour are
refused per line by name; every line comes out once; a JSON-schema constraint holds in every
beam (structured outputs inside beam search)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dfllm import LLM, BeamSearchParams
from dfllm.beam_search import beam_search_score
from dfllm.jobs.batch import BatchOptions, Engines, answer
from dfllm.jobs.batch_job import run_batch
from dfllm.jobs.openai_batch import parse_line
from dfllm.jobs.openai_requests import BEAM_REFUSED, LineError, parse_body
from dfllm.structured_outputs import StructuredOutputsParams

from run_batch_data import ENGINE, chat, check_line, line, read_jsonl, write_jsonl

pytestmark = pytest.mark.timeout(600)

PROMPT_IDS = [1, 450, 7586, 338]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["calm", "glad", "sad"]}},
    "required": ["ok", "mood"],
    "additionalProperties": False,
}
#: A JSON schema constraint without free whitespace, so that a random model's beams end.
TIGHT = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **ENGINE)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    with Engines(BatchOptions(model=str(tiny_llama), engine_kwargs=tuple(sorted(ENGINE.items())))) as e:
        yield e


def answered(engines, *rows: dict) -> list:
    return answer([parse_line(json.dumps(r), key=f"{k:04x}") for k, r in enumerate(rows)], engines)


def beam_completion(custom_id: str, prompt, **body) -> dict:
    body.setdefault("temperature", 0)
    return line(custom_id, "/v1/completions", prompt=prompt, use_beam_search=True, **body)


# ---- the request ---------------------------------------------------------------------------------------------
def test_vllm_server_fields_map_onto_beam_search_params():
    req = parse_body(
        "completions",
        {
            "prompt": "hi",
            "use_beam_search": True,
            "n": 3,
            "best_of": 7,  # ignored under beam search, as vLLM's server does
            "max_tokens": 5,
            "length_penalty": 0.5,
            "ignore_eos": True,
            "include_stop_str_in_output": True,
            "top_p": 1.0,  # neutral values of the refused fields are accepted
            "logit_bias": {},
            "stop": [],
        },
        "/v1/completions",
    )
    assert req.beam == BeamSearchParams(3, 5, True, 1.0, 0.5, True)  # temperature: vLLM's default 1
    assert req.params.logprobs == 6 and req.params.max_tokens == 5
    chat_req = parse_body(
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "temperature": 0, **TIGHT},
        "/v1/chat/completions",
    )
    assert chat_req.beam is not None and chat_req.beam.beam_width == 1 and chat_req.beam.temperature == 0
    assert chat_req.beam.structured_outputs == StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert chat_req.params.max_tokens is None  # a chat line without a limit: up to the context
    plain = parse_body("completions", {"prompt": "hi", "use_beam_search": False}, "/v1/completions")
    assert plain.beam is None


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(sorted(BEAM_REFUSED)),
    st.one_of(st.integers(2, 9), st.floats(0.1, 0.9), st.just({"5": 1.0}), st.just(["x"]), st.just("x")),
)
def test_fields_beam_search_cannot_honour_are_refused_by_name(name, value):
    neutral = BEAM_REFUSED[name]
    if any(value == v and type(value) is type(v) for v in neutral):
        return
    for endpoint, body in (
        ("completions", {"prompt": "hi"}),
        ("chat", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        with pytest.raises(LineError) as info:
            parse_body(endpoint, {**body, "use_beam_search": True, name: value}, "/v1/" + endpoint)
        assert info.value.param == f"body.{name}" and "beam search" in str(info.value)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"stream": True}, "body.stream"),
        ({"n": 0}, "body.n"),
        ({"max_tokens": 0}, "body.max_tokens"),
        ({"temperature": -1}, "body.temperature"),
        ({"length_penalty": "long"}, "body.length_penalty"),
        ({"use_beam_search": "yes"}, "body.use_beam_search"),
    ],
)
def test_bad_beam_fields_are_refused_by_name(body, param):
    with pytest.raises(LineError) as info:
        parse_body("completions", {"prompt": "hi", "use_beam_search": True, **body}, "/v1/completions")
    assert info.value.param == param


def test_length_penalty_without_beam_search_is_refused():
    with pytest.raises(LineError) as info:
        parse_body("completions", {"prompt": "hi", "length_penalty": 2.0}, "/v1/completions")
    assert info.value.param == "body.length_penalty"
    parse_body("completions", {"prompt": "hi", "length_penalty": 1.0}, "/v1/completions")  # neutral: accepted


# ---- the answers ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("width,max_tokens,penalty", [(1, 4, 1.0), (3, 5, 1.0), (2, 4, 0.5)])
def test_completion_choices_are_llm_beam_search_best_first(engines, llm, width, max_tokens, penalty):
    """A completions line's n choices are LLM.beam_search's beams in order, the continuation's
    text (without the end-of-sequence token), finish_reason "stop" for a beam that ended."""
    r = answered(
        engines,
        beam_completion("a", PROMPT_IDS, n=width, max_tokens=max_tokens, length_penalty=penalty, logprobs=2),
    )[0]
    assert r.status_code == 200, r.error
    expected = llm.beam_search(
        [{"prompt_token_ids": PROMPT_IDS}],
        BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty),
    )[0].sequences
    choices = r.body["choices"]
    assert [c["index"] for c in choices] == list(range(width)) == list(range(len(expected)))
    tok, eos = llm.get_tokenizer(), llm.get_tokenizer().eos_token_id
    for c, seq in zip(choices, expected):
        generated = seq.tokens[len(PROMPT_IDS) :]
        ended = bool(generated) and generated[-1] == eos
        assert c["finish_reason"] == ("stop" if ended else "length")
        assert c["stop_reason"] == (eos if ended else None)
        text_ids = generated[:-1] if ended else generated
        assert c["text"] == tok.decode(text_ids, skip_special_tokens=True)
        assert c["logprobs"]["token_logprobs"] == pytest.approx(
            [seq.logprobs[k][t].logprob for k, t in enumerate(text_ids)], abs=1e-4
        )
        assert all(len(top) <= 2 for top in c["logprobs"]["top_logprobs"])
    scores = [beam_search_score(s.tokens, s.cum_logprob, eos, penalty) for s in expected]
    assert scores == sorted(scores, reverse=True)


def test_a_chat_line_and_several_prompts_search_together(engines, llm):
    """Two completions prompts give n choices each (prompt i's beam j at i * n + j); a chat
    line's choices are the rendered conversation's beams; lines of both kinds and sampled
    lines in one call all get their answers."""
    rows = [
        beam_completion("two", [PROMPT_IDS, [1, 12, 99, 5]], n=2, max_tokens=3),
        chat("beam-chat", "What is the capital of France?", use_beam_search=True, n=2, max_completion_tokens=3),
        chat("sampled", "Hello"),
    ]
    two, beam_chat, sampled = answered(engines, *rows)
    assert [r.status_code for r in (two, beam_chat, sampled)] == [200, 200, 200]
    outs = llm.beam_search(
        [{"prompt_token_ids": PROMPT_IDS}, {"prompt_token_ids": [1, 12, 99, 5]}],
        BeamSearchParams(beam_width=2, max_tokens=3),
    )
    tok = llm.get_tokenizer()
    texts = [
        tok.decode(s.tokens[len(p) :], skip_special_tokens=True)
        for p, o in zip((PROMPT_IDS, [1, 12, 99, 5]), outs)
        for s in o.sequences
    ]
    assert [c["text"] for c in two.body["choices"]] == texts
    assert len(beam_chat.body["choices"]) == 2 and beam_chat.body["choices"][0]["message"]["role"] == "assistant"
    assert 0 < beam_chat.body["usage"]["completion_tokens"] <= 2 * 3
    assert len(sampled.body["choices"]) == 1


def test_structured_outputs_hold_in_every_beam(engines):
    """With a JSON schema, every beam's continuation is constrained: each choice parses and
    validates (the grammar only lets the end-of-sequence token follow a complete value). The
    candidates are the step's raw top-2n logprobs among the tokens the grammar allows, as in
    vLLM, so a random model's beams may be fewer than n."""
    r = answered(engines, beam_completion("json", PROMPT_IDS, n=3, max_tokens=40, **TIGHT))[0]
    assert r.status_code == 200, r.error
    assert 1 <= len(r.body["choices"]) <= 3
    for c in r.body["choices"]:
        assert c["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["text"]), SCHEMA)


@pytest.mark.slow
@pytest.mark.parametrize("width", [2, 3])
def test_every_beam_of_a_constrained_search_validates(tiny_llama, width):
    """Under ``logprobs_mode="processed_logprobs"`` the step's top-k are taken after the
    grammar's mask, so every beam branches among allowed tokens: ``width`` different beams, each
    a complete value of the schema."""
    processed = LLM(tiny_llama, logprobs_mode="processed_logprobs", **ENGINE)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    out = processed.beam_search(
        [{"prompt_token_ids": PROMPT_IDS}, "A reply:"],
        BeamSearchParams(beam_width=width, max_tokens=40, structured_outputs=so),
    )
    tok, eos = processed.get_tokenizer(), processed.get_tokenizer().eos_token_id
    for o, prompt_len in zip(out, (len(PROMPT_IDS), len(tok.encode("A reply:")))):
        assert len(o.sequences) == width
        assert len({tuple(s.tokens) for s in o.sequences}) == width
        for seq in o.sequences:
            assert seq.tokens[-1] == eos
            jsonschema.validate(json.loads(tok.decode(seq.tokens[prompt_len:-1])), SCHEMA)


def test_llm_beam_search_takes_structured_outputs(llm):
    so = StructuredOutputsParams(choice=["red", "green", "blue"])
    out = llm.beam_search(
        [{"prompt_token_ids": PROMPT_IDS}], BeamSearchParams(beam_width=2, max_tokens=10, structured_outputs=so)
    )[0]
    eos = llm.get_tokenizer().eos_token_id
    assert 1 <= len(out.sequences) <= 2
    for seq in out.sequences:
        assert seq.tokens[-1] == eos
        assert llm.get_tokenizer().decode(seq.tokens[len(PROMPT_IDS) : -1]) in ("red", "green", "blue")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 3), st.integers(1, 4), st.booleans())
def test_include_stop_str_and_ignore_eos(engines, width, max_tokens, include):
    r = answered(
        engines,
        beam_completion("a", PROMPT_IDS, n=width, max_tokens=max_tokens, include_stop_str_in_output=include),
        beam_completion("b", PROMPT_IDS, n=width, max_tokens=max_tokens, ignore_eos=True),
    )
    assert [x.status_code for x in r] == [200, 200]
    assert len(r[0].body["choices"]) == width and len(r[1].body["choices"]) == width
    assert all(c["finish_reason"] == "length" for c in r[1].body["choices"])  # ignore_eos: never "stop"
    assert r[0].body["usage"]["completion_tokens"] <= width * max_tokens


def test_run_batch_answers_every_line_once(tiny_llama, tmp_path):
    """A file mixing beam search lines (good and refused), sampled lines and bad JSON: every
    line answered once, in order, each parsing as OpenAI's types."""
    rows = [
        beam_completion("beam", PROMPT_IDS, n=2, max_tokens=3),
        beam_completion("refused", PROMPT_IDS, n=2, top_p=0.5),
        beam_completion("too-wide", PROMPT_IDS, n=500),
        chat("beam-chat", "Hi", use_beam_search=True, n=2, **TIGHT, max_completion_tokens=40),
        chat("sampled", "Hello"),
        "{not json",
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = run_batch(str(src), str(tmp_path / "out.jsonl"), model=str(tiny_llama), progress=False, **ENGINE)
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [o["custom_id"] for o in out] == ["beam", "refused", "too-wide", "beam-chat", "sampled", None]
    for o in out:
        check_line(o)
    by = {o["custom_id"]: o for o in out}
    assert len(by["beam"]["response"]["body"]["choices"]) == 2
    assert by["refused"]["error"]["param"] == "body.top_p"
    assert by["too-wide"]["error"]["param"] == "body.n"  # 2 * n logprobs past max_logprobs
    for c in by["beam-chat"]["response"]["body"]["choices"]:
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    assert summary is not None
