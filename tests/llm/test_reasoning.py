"""Reasoning as its own column (#35): vLLM's ``qwen3`` and ``deepseek_r1`` reasoning parsers on
strings and token ids, rule by rule, and on real engine output of a tiny Qwen3.

The model is a random Qwen3 (the bundled SmolLM2 tokenizer plus ``<think>``/``</think>`` and
Qwen's tool-call tags, and a Qwen3-style chat template that honours ``enable_thinking``) whose
attention and MLP outputs are zeroed and whose embeddings and LM head make it a bigram
machine, so that greedy decoding writes a known thinking trace: after ``"\\n"`` (the end of
the template's ``<think>\\n``) it writes `` wait so</think> Paris`` and stops; after a ``:`` it
first writes ``<think>`` itself. Every output below is the engine's own.
"""

from __future__ import annotations

import dask.dataframe as dd
import pandas as pd
import pyarrow as pa
import pytest
from transformers import AutoTokenizer

import dfllm
from dfllm import LLM, SamplingParams
from dfllm.reasoning import (
    BaseThinkingReasoningParser,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    get_reasoning_parser,
    make_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

from reasoning_data import ANSWER, CONV, REASONING, SMALL, ids_of

GREEDY = dict(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def tok(thinker):
    return AutoTokenizer.from_pretrained(thinker)


@pytest.fixture(scope="module")
def qwen3(thinker) -> LLM:
    return LLM(thinker, reasoning_parser="qwen3", **SMALL)


@pytest.fixture(scope="module")
def r1(thinker) -> LLM:
    return LLM(thinker, reasoning_parser="deepseek_r1", **SMALL)


def one(outputs):
    assert len(outputs) == 1 and len(outputs[0].outputs) == 1
    return outputs[0].outputs[0]


# ---- the parsers on strings ---------------------------------------------------------------------------
R1_CASES = [  # (output text, (reasoning, answer)): the base rules
    ("abc</think>xyz", ("abc", "xyz")),
    ("abc</think>", ("abc", None)),  # nothing after the end: no answer
    ("abc", ("abc", None)),  # no end: all reasoning (the template opened <think>, or cut short)
    ("", ("", None)),
    ("<think>abc</think>xyz", ("abc", "xyz")),  # a generated <think> is dropped
    ("pre<think>abc</think>xyz", ("abc", "xyz")),  # ... with what precedes it
    ("pre<think>abc", ("abc", None)),
    ("a</think>b</think>c", ("a", "b</think>c")),  # the first end splits
    ("</think>xyz", ("", "xyz")),
]
QWEN3_CASES = R1_CASES + [
    ("plan<tool_call>\n<function=get_weather>\n", ("plan", "<tool_call>\n<function=get_weather>\n")),
    ('<tool_call> <function name="f">', (None, '<tool_call> <function name="f">')),  # empty reasoning: None
    ("I could write <tool_call> here", ("I could write <tool_call> here", None)),  # a mention ends nothing
    ("a</think>b<tool_call>\n<function=f>", ("a", "b<tool_call>\n<function=f>")),  # </think> first
]
QWEN3_OFF_CASES = [  # enable_thinking=False: an output without </think> is all answer
    ("xyz", (None, "xyz")),
    ("<think>xyz", (None, "xyz")),
    ("abc</think>xyz", ("abc", "xyz")),
    ("plan<tool_call>\n<function=f>", (None, "plan<tool_call>\n<function=f>")),
    ("", (None, "")),
]


@pytest.mark.parametrize("text,expected", R1_CASES)
def test_deepseek_r1_splits_text(tok, text, expected):
    assert make_reasoning_parser("deepseek_r1", tok).extract_reasoning(text) == expected


@pytest.mark.parametrize("text,expected", QWEN3_CASES)
def test_qwen3_splits_text(tok, text, expected):
    assert make_reasoning_parser("qwen3", tok).extract_reasoning(text) == expected


@pytest.mark.parametrize("text,expected", QWEN3_OFF_CASES)
def test_qwen3_without_thinking_keeps_the_answer(tok, text, expected):
    parser = make_reasoning_parser("qwen3", tok, {"enable_thinking": False})
    assert parser.extract_reasoning(text) == expected
    # the same through for_request, from the engine's parser: a copy, the engine's unchanged
    engine = make_reasoning_parser("qwen3", tok)
    assert engine.for_request({"enable_thinking": False}).extract_reasoning(text) == expected
    assert engine.thinking_enabled and engine.for_request({"enable_thinking": True}) is engine
    assert engine.for_request(None) is engine and engine.for_request({"other": 1}) is engine


def test_deepseek_r1_ignores_enable_thinking(tok):
    parser = make_reasoning_parser("deepseek_r1", tok)
    assert parser.for_request({"enable_thinking": False}) is parser
    assert parser.extract_reasoning("xyz") == ("xyz", None)


# ---- the parsers on token ids ---------------------------------------------------------------------------
def test_is_reasoning_end_the_last_marker_decides(tok):
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    a, b = ids_of(tok, " wait so")
    for name in ("deepseek_r1", "qwen3"):
        p = make_reasoning_parser(name, tok)
        assert (p.start_token_id, p.end_token_id) == (think, end)
        assert not p.is_reasoning_end([])
        assert not p.is_reasoning_end([a, b])  # no marker: not ended
        assert not p.is_reasoning_end([a, think, b])
        assert p.is_reasoning_end([think, a, end, b])
        assert not p.is_reasoning_end([think, a, end, b, think, a])  # a new block opened
        assert p.is_reasoning_end([end])
        # the engine asks of each new token: does the reasoning end here?
        assert p.is_reasoning_end_streaming([think, a, end], [end])
        assert not p.is_reasoning_end_streaming([think, a, b], [b])
        assert p.extract_content_ids([a, end, b, a]) == [b, a]
        assert p.extract_content_ids([a, end]) == []  # the end token last: nothing after it
        assert p.extract_content_ids([a, b]) == []
        assert p.count_reasoning_tokens([a, end, b]) == 0  # vLLM's default: not counted


def test_qwen3_tool_call_ends_reasoning_only_before_a_function(tok):
    p = make_reasoning_parser("qwen3", tok)
    think, tc, tc_end = tok.convert_tokens_to_ids(["<think>", "<tool_call>", "</tool_call>"])
    a = ids_of(tok, " wait")
    function = ids_of(tok, "\n<function=get_weather>")
    assert p.is_reasoning_end([think, *a, tc, *function])
    assert not p.is_reasoning_end([think, *a, tc])  # nothing follows yet
    assert not p.is_reasoning_end([think, *a, tc, *ids_of(tok, " is a tag")])  # a mention
    assert not p.is_reasoning_end([tc, *function, tc_end, think, *a])  # a paired example, then <think>
    assert not p.is_reasoning_end([think, tc, *function, tc_end, *a])  # a paired one is skipped
    assert p.extract_content_ids([*a, tc, *function]) == [tc, *function]
    assert p.is_reasoning_end_streaming([think, *a, tc, *function], [tc, *function])
    assert not p.is_reasoning_end_streaming([think, *a, tc], [tc])  # not confirmed yet


# ---- the registry and the arguments ---------------------------------------------------------------------
def test_registry_names_and_unknown_names():
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert issubclass(get_reasoning_parser("deepseek_r1"), BaseThinkingReasoningParser)
    with pytest.raises(ValueError, match=r"reasoning_parser='qwen' is not a known .*\['deepseek_r1', 'qwen3'\]"):
        get_reasoning_parser("qwen")
    with pytest.raises(ValueError, match=r"reasoning_parser='nope' .*deepseek_r1"):  # before any loading
        LLM("/nonexistent/model", reasoning_parser="nope")
    with pytest.raises(ValueError, match=r"structured_outputs_config\['reasoning_parser'\]='nope'"):
        LLM("/nonexistent/model", structured_outputs_config={"reasoning_parser": "nope"})
    with pytest.raises(ValueError, match="enable_in_reasoning"):
        LLM("/nonexistent/model", structured_outputs_config={"enable_in_reasoning": "yes"})


def test_register_a_parser_of_ones_own(tok):
    @register_reasoning_parser("test_think_only")
    class ThinkOnly(DeepSeekR1ReasoningParser):
        """Reasoning between the same tags; no end means no reasoning."""

        def extract_reasoning(self, model_output, request=None):
            if self.end_token not in model_output:
                return None, model_output
            return super().extract_reasoning(model_output, request)

    try:
        assert get_reasoning_parser("test_think_only") is ThinkOnly
        assert make_reasoning_parser("test_think_only", tok).extract_reasoning("xyz") == (None, "xyz")
    finally:
        from dfllm import reasoning

        del reasoning._PARSERS["test_think_only"]


def test_a_tokenizer_without_think_tokens_is_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"reasoning_parser='qwen3': the tokenizer has no token <think> or </think>"):
        LLM(tiny_llama, reasoning_parser="qwen3", **SMALL)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        LLM(tiny_llama, reasoning_parser="deepseek_r1", skip_tokenizer_init=True, **SMALL)


# ---- real engine output -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_chat_splits_reasoning_from_the_answer(qwen3, r1, thinker, tok):
    end = tok.convert_tokens_to_ids("</think>")
    for llm in (qwen3, r1):
        outs = llm.chat([CONV, CONV], SamplingParams(**GREEDY), use_tqdm=False)
        for c in (o.outputs[0] for o in outs):  # the second is computed once with the first: the same split
            assert (c.reasoning_content, c.text, c.finish_reason) == (REASONING, ANSWER, "stop")
            assert c.token_ids == ids_of(tok, REASONING) + [end] + ids_of(tok, ANSWER) + [tok.eos_token_id]
    # without a parser the same generation is the raw text, with no reasoning field
    raw = one(LLM(thinker, **SMALL).chat([CONV], SamplingParams(**GREEDY), use_tqdm=False))
    assert (raw.text, raw.reasoning_content) == (REASONING + "</think>" + ANSWER, None)


def test_a_generated_think_tag_is_dropped(qwen3, r1):
    for llm in (qwen3, r1):  # after ":" the model writes <think> itself (an older Qwen3 template)
        c = one(llm.generate(["Capital of France:"], SamplingParams(**GREEDY), use_tqdm=False))
        assert (c.reasoning_content, c.text) == (REASONING, ANSWER)


def test_reasoning_cut_short_has_no_answer(qwen3, r1):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for llm in (qwen3, r1):
        c = one(llm.chat([CONV], params, use_tqdm=False))
        assert (c.reasoning_content, c.text, c.finish_reason) == (REASONING, "", "length")
    # Qwen3 with thinking off: an output without </think> is the answer (DeepSeek-R1: reasoning)
    off = {"enable_thinking": False}
    c = one(qwen3.chat([CONV], params, use_tqdm=False, chat_template_kwargs=off))
    assert (c.reasoning_content, c.text) == (None, REASONING)
    c = one(r1.chat([CONV], params, use_tqdm=False, chat_template_kwargs=off))
    assert (c.reasoning_content, c.text) == (REASONING, "")


def test_structured_output_constrains_the_answer_only(qwen3, tok):
    """The choice grammar would forbid " wait" as a first token: the reasoning ran free, the
    grammar engaged after </think> (which it never saw), and the answer is a choice."""
    end = tok.convert_tokens_to_ids("</think>")
    params = SamplingParams(**GREEDY, structured_outputs={"choice": ["yes", "no"]})
    c = one(qwen3.chat([CONV], params, use_tqdm=False))
    assert c.reasoning_content == REASONING and c.text in ("yes", "no")
    assert c.token_ids[:3] == ids_of(tok, REASONING) + [end] and c.token_ids.count(end) == 1
    assert c.structured_output_complete and c.finish_reason == "stop"
    # the reasoning cut short: the answer never started, so the constraint is not met
    c = one(
        qwen3.chat(
            [CONV],
            SamplingParams(temperature=0.0, max_tokens=2, structured_outputs={"choice": ["yes"]}),
            use_tqdm=False,
        )
    )
    assert (c.reasoning_content, c.text, c.structured_output_complete) == (REASONING, "", False)


def test_a_prompt_that_ends_the_reasoning_constrains_from_the_first_token(qwen3, r1, tok):
    """enable_thinking=False: the template closes </think> in the prompt, so the grammar is
    engaged at once; Qwen3's parser then reads the output as the answer, DeepSeek-R1's (which
    has no enable_thinking) as reasoning with no answer, as in vLLM."""
    params = SamplingParams(**GREEDY, structured_outputs={"choice": ["yes", "no"]})
    off = {"enable_thinking": False}
    c = one(qwen3.chat([CONV], params, use_tqdm=False, chat_template_kwargs=off))
    assert c.reasoning_content is None and c.text in ("yes", "no") and c.structured_output_complete
    assert tok.convert_tokens_to_ids("</think>") not in c.token_ids
    c = one(r1.chat([CONV], params, use_tqdm=False, chat_template_kwargs=off))
    assert c.reasoning_content in ("yes", "no") and c.text == "" and c.structured_output_complete


@pytest.mark.slow
def test_enable_in_reasoning_constrains_the_reasoning_too(thinker):
    llm = LLM(thinker, reasoning_parser="qwen3", structured_outputs_config={"enable_in_reasoning": True}, **SMALL)
    params = SamplingParams(**GREEDY, structured_outputs={"choice": ["yes", "no"]})
    c = one(llm.chat([CONV], params, use_tqdm=False))
    # the grammar ran from the first token: no </think>, so Qwen3's parser calls it reasoning
    assert c.reasoning_content in ("yes", "no") and c.text == "" and c.structured_output_complete
    also = LLM(thinker, structured_outputs_config={"reasoning_parser": "qwen3"}, **SMALL)  # vLLM's other spelling
    assert (one(also.chat([CONV], SamplingParams(**GREEDY), use_tqdm=False)).reasoning_content) == REASONING


# ---- dataframes, the processor and the command line ---------------------------------------------------
@pytest.mark.slow
def test_dataframe_chat_adds_a_reasoning_column(thinker):
    df = pd.DataFrame({"q": ["Capital of France?", "Capital of Spain?"]})
    out = df.llm.chat(
        "{q}",
        model=str(thinker),
        sampling_params=GREEDY,
        reasoning_parser="qwen3",
        engine_columns=["num_cached_tokens"],
        **SMALL,
    )
    assert list(out.columns) == [
        "q",
        "generated_text",
        "num_input_tokens",
        "num_generated_tokens",
        "finish_reason",
        "num_cached_tokens",
        "reasoning_content",
        "llm_error",
    ]
    assert out["reasoning_content"].dtype == out["llm_error"].dtype == pd.ArrowDtype(pa.string())
    assert out["reasoning_content"].tolist() == [REASONING] * 2 and out["generated_text"].tolist() == [ANSWER] * 2
    typed = df.llm.chat(
        "{q}", model=str(thinker), sampling_params=GREEDY, reasoning_parser="qwen3", choice=["yes", "no"], **SMALL
    )
    assert typed["reasoning_content"].tolist() == [REASONING] * 2
    assert typed["generated_text"].isin(["yes", "no"]).all() and typed["llm_error"].isna().all()
    # no parser, no column; a Dask frame's meta has it, typed, without running a model
    assert (
        "reasoning_content" not in df.llm.generate("{q}:", model=str(thinker), sampling_params=GREEDY, **SMALL).columns
    )
    lazy = dd.from_pandas(df, npartitions=1).llm.generate("{q}:", model=str(thinker), reasoning_parser="deepseek_r1")
    assert lazy._meta.dtypes["reasoning_content"] == out["reasoning_content"].dtype
    with pytest.raises(ValueError, match=r"generate: reasoning_parser='qwen35' is not a known"):
        df.llm.generate("{q}", model=str(thinker), reasoning_parser="qwen35")


def test_processor_rows_carry_reasoning_content(thinker):
    """Ray's engine_kwargs carry reasoning_parser; the config's chat_template_kwargs reach the
    parser (Qwen3 with thinking off: an output without </think> is the answer)."""
    rows = pd.DataFrame({"id": [0, 1]})
    engine = {"reasoning_parser": "qwen3", **SMALL}
    pre = lambda row: {"messages": CONV, "sampling_params": {"temperature": 0.0, "max_tokens": 2}}  # noqa: E731
    on = dfllm.build_processor(dfllm.ProcessorConfig(model_source=str(thinker), engine_kwargs=engine), preprocess=pre)
    got = on(rows)
    assert got["reasoning_content"].tolist() == [REASONING] * 2 and got["generated_text"].tolist() == [""] * 2
    off = dfllm.build_processor(
        dfllm.ProcessorConfig(
            model_source=str(thinker), engine_kwargs=engine, chat_template_kwargs={"enable_thinking": False}
        ),
        preprocess=pre,
    )
    got = off(rows)
    assert got["reasoning_content"].isna().all() and got["generated_text"].tolist() == [REASONING] * 2


@pytest.mark.slow
def test_command_line_reasoning_parser(thinker, tmp_path):
    from dfllm.jobs.cli import build_job, build_parser

    src = tmp_path / "in.parquet"
    pd.DataFrame({"q": ["Capital of France"]}).to_parquet(src)
    args = build_parser().parse_args(
        [
            "run",
            str(src),
            str(tmp_path / "out"),
            "--prompt",
            "{q}:",
            "--model",
            str(thinker),
            "--max-model-len",
            "128",
            "--reasoning-parser",
            "deepseek_r1",
        ]
    )
    got = build_job(args).compute()
    assert got["reasoning_content"].tolist() == [REASONING] and got["generated_text"].tolist() == [ANSWER]
    with pytest.raises(SystemExit):  # argparse: exit status 2, naming the choices
        build_parser().parse_args(["run", "a", "b", "--reasoning-parser", "nope"])
    args = build_parser().parse_args(
        ["run", str(src), "o", "--task", "embed", "--prompt", "q", "--reasoning-parser", "qwen3"]
    )
    with pytest.raises(ValueError, match="--reasoning-parser applies to --task generate or chat"):
        build_job(args)
