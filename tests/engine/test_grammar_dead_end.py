"""A grammar that allows no token where a row stands (an empty language, or characters the
tokenizer cannot spell: SmolLM2's byte-level vocabulary has no token for the byte 0xF1, so
U+41844 cannot be written) ends that row with ``finish_reason="error"`` and a message saying
so, as vLLM's scheduler terminates a request whose grammar rejects its token; it used to end
with ``"stop"``, an empty text and the token drawn from fully masked logits (id 0) as its
output, which read as a success."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from dfllm import LLM, BeamSearchParams, SamplingParams
from dfllm.beam_search import NO_SEQUENCE, BeamSearchError
from dfllm.engine.structured import GRAMMAR_DEAD_END
from dfllm.jobs.batch import BatchOptions, Engines, answer
from dfllm.jobs.openai_batch import parse_line
from dfllm.outputs import RequestFailedError
from dfllm.structured_outputs import StructuredOutputsParams

UNSPELLABLE = "\U00041844"  # UTF-8 f1 81 a1 84: no token of SmolLM2's vocabulary starts with byte f1


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, tiny_llama):
    return LLM(tiny_llama, max_model_len=64, max_num_seqs=4, seed=0, async_scheduling=request.param)


@pytest.mark.parametrize(
    "constraint, kept",
    [
        ({"grammar": "root ::= root"}, ""),  # a language with no string at all
        ({"regex": UNSPELLABLE}, ""),
        ({"choice": [UNSPELLABLE]}, ""),
        ({"regex": "ab" + UNSPELLABLE}, "ab"),  # a dead end after some output: that output is kept
    ],
)
def test_a_grammar_that_allows_no_token_is_the_rows_error(llm, constraint, kept):
    ok = SamplingParams(max_tokens=4, temperature=0)
    bad = SamplingParams(max_tokens=8, temperature=0, structured_outputs=constraint)
    with pytest.raises(RequestFailedError) as info:
        llm.generate(["fine", "dead end", "fine too"], [ok, bad, ok], use_tqdm=False)
    outs = info.value.outputs
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    dead = outs[1].outputs[0]
    assert dead.text == kept and dead.structured_output_complete is False
    assert "structured outputs: no token can continue the output at output token 0" in dead.error or kept
    assert dead.error.endswith(GRAMMAR_DEAD_END)
    assert 0 not in dead.token_ids  # what the fully masked logits gave is not part of the output
    assert "prompt 1: structured outputs: no token can continue" in str(info.value)


def test_a_spellable_constraint_still_completes(llm):
    out = llm.generate(
        "x", SamplingParams(max_tokens=8, temperature=0, structured_outputs={"regex": "😀"}), use_tqdm=False
    )
    assert out[0].outputs[0].text == "😀" and out[0].outputs[0].structured_output_complete


@pytest.mark.parametrize(
    "constraint", [{"grammar": "root ::= root"}, {"regex": UNSPELLABLE}, {"regex": "ab" + UNSPELLABLE}]
)
def test_beam_search_whose_every_beam_reaches_a_dead_end_raises_naming_the_prompt(llm, constraint):
    """Before, such a prompt came back with no sequence at all, or with a dead-end beam as if
    complete; a dead-end beam is dropped, and a prompt left with none is named."""
    params = BeamSearchParams(beam_width=2, max_tokens=6, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(BeamSearchError) as info:
        llm.beam_search([{"prompt": "hi"}], params)
    assert str(info.value) == f"prompt 0: {NO_SEQUENCE}" and info.value.failed == [0]
    assert info.value.outputs is not None and info.value.outputs[0].sequences == []
    fine = BeamSearchParams(beam_width=2, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="ab"))
    assert all(s.text.endswith("ab<|im_end|>") for s in llm.beam_search([{"prompt": "hi"}], fine)[0].sequences)


@pytest.mark.parametrize("beams", [False, True], ids=["generate", "beam_search"])
def test_a_dead_end_is_each_rows_and_lines_error(tiny_llama, beams):
    """On a dataframe every row comes out with the error (it said "structured output
    incomplete ... raise max_tokens"); in run-batch the line's error answer."""
    engine = {"max_model_len": 64, "max_num_seqs": 4, "seed": 0}
    params = BeamSearchParams(beam_width=2, max_tokens=5) if beams else SamplingParams(max_tokens=5)
    frame = pd.DataFrame({"q": ["a", "b", "c"]})
    out = frame.llm.generate(
        "q", model=str(tiny_llama), sampling_params=params, choice=[UNSPELLABLE, "x" + UNSPELLABLE], **engine
    )
    assert out["finish_reason"].tolist() == ["error"] * 3
    assert all(e.endswith(GRAMMAR_DEAD_END) for e in out["llm_error"]) and out["generated_text"].isna().all()
    body = {"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "use_beam_search": beams}
    line = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/completions",
        "body": {**body, "structured_outputs": {"regex": UNSPELLABLE}},
    }
    with Engines(BatchOptions(model=str(tiny_llama), engine_kwargs=tuple(sorted(engine.items())))) as engines:
        result = answer([parse_line(json.dumps(line), key="0001")], engines)[0]
    assert result.status_code != 200 and str(result.error).endswith(GRAMMAR_DEAD_END)
