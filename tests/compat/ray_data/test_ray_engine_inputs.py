"""What a Ray Data LLM user's preprocess may hand the engine besides ``messages``/``prompt``
and ``sampling_params``, and what postprocess then reads: ``logprobs`` and
``prompt_logprobs`` (as Ray's vLLM engine stage gives them), ``tokenized_prompt``, an
assistant prefill, ``chat_template_kwargs``, per-row ``pooling_params``, Ray's
``guided_decoding``, and ``detokenize=False`` under the detokenize stage. Each is checked
against dfllm's vLLM-style ``LLM`` API on the same inputs."""

from __future__ import annotations

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import dfllm
from dfllm import build_processor, vLLMEngineProcessorConfig
from dfllm.jobs.processor import RowFailedError
from dfllm.jobs.ray_config import ChatTemplateStageConfig

ENGINE = {"max_model_len": 256}
GREEDY = dict(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return dfllm.LLM(str(tiny_llama), **ENGINE)


def config(model, **fields) -> vLLMEngineProcessorConfig:
    return vLLMEngineProcessorConfig(model_source=str(model), engine_kwargs=ENGINE, **fields)


def run(processor, frame: pd.DataFrame, npartitions: int = 2) -> pd.DataFrame:
    return processor(dd.from_pandas(frame, npartitions=npartitions)).compute().sort_index()


def ray_logprobs(steps) -> list:
    """vLLM's logprobs as Ray's engine stage converts them (``dataclasses.asdict`` per entry)."""
    return [
        None
        if s is None
        else {t: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in s.items()}
        for s in steps
    ]


def assert_same_logprobs(got: list, want: list) -> None:
    """The same token ids, ranks and texts at every step; logprobs equal up to batching's float noise."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert set(g) == set(w)
        for t in w:
            assert set(g[t]) == {"logprob", "rank", "decoded_token"}
            assert (g[t]["rank"], g[t]["decoded_token"]) == (w[t]["rank"], w[t]["decoded_token"])
            assert g[t]["logprob"] == pytest.approx(w[t]["logprob"], abs=1e-4)


def test_logprobs_and_prompt_logprobs_as_ray_gives_them(tiny_llama, llm):
    asks = [dict(GREEDY, logprobs=2), dict(GREEDY), dict(GREEDY, logprobs=0, prompt_logprobs=1)]
    frame = pd.DataFrame({"q": ["Name a colour.", "Say hello.", "Count to three."], "ask": range(3)})
    seen = {}

    def post(row):
        seen[row["ask"]] = (row["logprobs"], row["prompt_logprobs"])
        return dict(ask=row["ask"], text=row["generated_text"])

    processor = build_processor(
        config(tiny_llama),
        lambda r: dict(messages=[{"role": "user", "content": r["q"]}], sampling_params=asks[r["ask"]]),
        post,
    )
    got = run(processor, frame)
    assert "llm_error" not in got.columns  # Ray's default: a failed row fails the job, no error column
    refs = llm.chat(
        [[{"role": "user", "content": q}] for q in frame["q"]],
        [dfllm.SamplingParams(**a) for a in asks],
        use_tqdm=False,
    )
    for i, ref in enumerate(refs):
        logprobs, prompt_logprobs = seen[i]
        assert got.loc[i, "text"] == ref.outputs[0].text
        if "logprobs" not in asks[i]:
            assert logprobs is None and prompt_logprobs is None  # not asked: None, as in Ray
            continue
        assert_same_logprobs(logprobs, ray_logprobs(ref.outputs[0].logprobs))
        assert len(logprobs) == len(ref.outputs[0].token_ids)
        for token, step in zip(ref.outputs[0].token_ids, logprobs):  # the sampled token is always there
            assert token in step
        assert all(len(step) <= asks[i]["logprobs"] + 1 for step in logprobs)
        if asks[i].get("prompt_logprobs"):
            assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ref.prompt_token_ids)
            assert_same_logprobs(prompt_logprobs, ray_logprobs(ref.prompt_logprobs))
        else:
            assert prompt_logprobs is None


def test_logprobs_kept_without_postprocess_are_a_map_column(tiny_llama):
    frame = pd.DataFrame({"q": ["Say hello.", "Pick a fruit."]})
    processor = build_processor(
        config(tiny_llama), lambda r: dict(prompt=r["q"], sampling_params=dict(GREEDY, logprobs=1))
    )
    lazy = processor(dd.from_pandas(frame, npartitions=2))
    got = lazy.compute()
    assert str(got.dtypes["logprobs"]).startswith("list<item: map<int64, struct<logprob: double")
    assert lazy.dtypes["logprobs"] == got.dtypes["logprobs"] and "llm_error" not in got.columns
    assert (got["logprobs"].list.len() == got["num_generated_tokens"]).all()
    assert got["prompt_logprobs"].isna().all()  # not asked


def test_tokenized_prompt_is_generated_from_as_given(tiny_llama, llm):
    """Ray's ``tokenized_prompt``: token ids generated from as they are; rows of one
    partition may mix token ids, prompts and conversations, each getting its own; bad ones
    are kept, with their error, under Ray's ``should_continue_on_error=True``."""
    tok = llm.get_tokenizer()
    ids = tok.encode("Once upon a time")
    rows = [
        dict(tokenized_prompt=np.array(ids)),
        dict(prompt="Once upon a time"),
        dict(messages=[{"role": "user", "content": "Hi"}]),
        dict(tokenized_prompt=ids, prompt="the text I tokenized"),
        dict(tokenized_prompt=[10**9]),
        dict(tokenized_prompt="not ids"),
        dict(nothing=1),
    ]
    frame = pd.DataFrame({"i": range(len(rows))})
    processor = build_processor(
        config(tiny_llama, should_continue_on_error=True),
        lambda r: dict(rows[r["i"]], sampling_params=GREEDY),
        lambda r: dict(i=r["i"], text=r["generated_text"], prompt=r["prompt"], ids=list(r["prompt_token_ids"])),
    )
    got = run(processor, frame, npartitions=1)
    params = dfllm.SamplingParams(**GREEDY)
    by_ids = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    by_text = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    chat = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)[0]
    assert got.loc[0, "text"] == got.loc[3, "text"] == by_ids.outputs[0].text
    assert got.loc[0, "ids"] == got.loc[3, "ids"] == ids
    assert got.loc[0, "prompt"] == tok.decode(ids)  # no prompt given: the token ids' text
    assert got.loc[3, "prompt"] == "the text I tokenized"
    assert got.loc[1, "text"] == by_text.outputs[0].text and got.loc[2, "text"] == chat.outputs[0].text
    errors = got["__inference_error__"]
    assert errors.loc[:3].isna().all()
    assert "out of vocabulary" in errors[4] or "vocab" in errors[4]
    assert "tokenized_prompt" in errors[5] and "list of token ids" in errors[5]
    assert "no 'messages', 'prompt' or 'tokenized_prompt'" in errors[6]


def test_assistant_prefill_is_continued(tiny_llama, llm):
    """A conversation ending with an assistant message is continued, as Ray's chat template
    stage does (``continue_final_message=True``, no generation prompt)."""
    prefill = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
    ask = [{"role": "user", "content": "Name a colour."}]
    frame = pd.DataFrame({"prefill": [True, False]})
    processor = build_processor(
        config(tiny_llama),
        lambda r: dict(messages=prefill if r["prefill"] else ask, sampling_params=GREEDY),
        lambda r: dict(prompt=r["prompt"], text=r["generated_text"]),
    )
    got = run(processor, frame)
    params = dfllm.SamplingParams(**GREEDY)
    cont = llm.chat(prefill, params, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    answer = llm.chat(ask, params, use_tqdm=False)[0]
    assert got.loc[0, "prompt"] == cont.prompt and got.loc[0, "prompt"].endswith("My answer is")
    assert got.loc[0, "text"] == cont.outputs[0].text
    assert got.loc[1, "prompt"] == answer.prompt and got.loc[1, "text"] == answer.outputs[0].text


TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{{ greeting | default('') }}{% endif %}"
)


@pytest.mark.parametrize("where", ["config", "stage", "builder_kwargs"])
def test_chat_template_kwargs_reach_the_template(tiny_llama, llm, where):
    kwargs = {"greeting": "Ahoy!"}
    fields = {
        "config": dict(chat_template=TEMPLATE, chat_template_kwargs=kwargs),
        "stage": dict(chat_template_stage=ChatTemplateStageConfig(chat_template=TEMPLATE, chat_template_kwargs=kwargs)),
        "builder_kwargs": dict(chat_template=TEMPLATE),
    }[where]
    frame = pd.DataFrame({"q": ["Hi", "Bye"], "own": [None, "Hello!"]})

    def pre(row):
        out = dict(messages=[{"role": "user", "content": row["q"]}], sampling_params=GREEDY)
        if row["own"] is not None:
            out["chat_template_kwargs"] = {"greeting": row["own"]}  # a row's own, over the config's
        return out

    processor = build_processor(
        config(tiny_llama, **fields),
        pre,
        lambda r: dict(prompt=r["prompt"]),
        builder_kwargs={"chat_template_kwargs": kwargs} if where == "builder_kwargs" else None,
    )
    got = run(processor, frame, npartitions=1)  # one batch: a row without its own beside one with
    assert "llm_error" not in got.columns
    for i, greeting in enumerate(["Ahoy!", "Hello!"]):
        ref = llm.chat(
            [{"role": "user", "content": frame.loc[i, "q"]}],
            dfllm.SamplingParams(**GREEDY),
            chat_template=TEMPLATE,
            chat_template_kwargs={"greeting": greeting},
            use_tqdm=False,
        )[0]
        assert got.loc[i, "prompt"] == ref.prompt and ref.prompt.endswith(f"<assistant>{greeting}")


def test_bad_row_chat_template_kwargs_is_that_rows_error(tiny_llama):
    frame = pd.DataFrame({"q": ["Hi", "Bye"]})
    processor = build_processor(
        config(tiny_llama, should_continue_on_error=True),
        lambda r: dict(
            messages=[{"role": "user", "content": r["q"]}],
            sampling_params=GREEDY,
            chat_template_kwargs=None if r["q"] == "Hi" else ["not", "a", "dict"],
        ),
    )
    errors = processor(frame)["__inference_error__"]
    assert pd.isna(errors[0])
    assert errors[1].startswith("chat_template_kwargs:") and "dict" in errors[1]
    with pytest.raises(RowFailedError, match="row 1 failed: chat_template_kwargs:"):  # Ray's default
        build_processor(config(tiny_llama), processor.preprocess)(frame)


@pytest.mark.slow
def test_pooling_params_per_row():
    """Ray lets preprocess return ``pooling_params``: each row's own reach the model."""
    texts = ["a cat sat on the mat today", "a dog", "a fish swam in the sea", "bad"]
    params = [{"truncate_prompt_tokens": 3}, {"normalize": False}, None, {"bogus": 1}]
    frame = pd.DataFrame({"text": texts, "i": range(4)})
    processor = build_processor(
        vLLMEngineProcessorConfig(
            model_source=None, task_type="embed", chat_template_stage=False, should_continue_on_error=True
        ),
        lambda r: dict(prompt=r["text"], **({} if params[r["i"]] is None else {"pooling_params": params[r["i"]]})),
        lambda r: dict(i=r["i"], vector=list(r["embeddings"])),
    )
    got = run(processor, frame)
    ref = dfllm.LLM("all-minilm-l6-v2")
    for i in range(3):
        want = ref.embed(texts[i], dfllm.PoolingParams(**(params[i] or {})), use_tqdm=False)[0].outputs.embedding
        np.testing.assert_allclose(np.asarray(got.loc[i, "vector"]), np.asarray(want), rtol=1e-5, atol=1e-6)
    errors = got["__inference_error__"]
    assert errors.loc[:2].isna().all()
    assert errors[3].startswith("pooling_params:") and "bogus" in errors[3]
    # the three differ: truncated, unnormalised, default
    norms = [np.linalg.norm(np.asarray(v)) for v in got.loc[:2, "vector"]]
    assert abs(norms[0] - 1) < 1e-4 and abs(norms[1] - 1) > 1e-3 and abs(norms[2] - 1) < 1e-4


@pytest.mark.slow
def test_pooling_params_per_row_classify_and_score(tmp_path):
    from helpers import build_tiny_classifier

    path = build_tiny_classifier(tmp_path)
    frame = pd.DataFrame({"text": ["good film", "bad film"], "raw": [False, True]})
    processor = build_processor(
        vLLMEngineProcessorConfig(model_source=str(path), task_type="classify", apply_chat_template=False),
        lambda r: dict(prompt=r["text"], pooling_params={"use_activation": not r["raw"]}),
        lambda r: dict(logits=list(r["embeddings"])),
    )
    got = run(processor, frame)
    ref = dfllm.LLM(str(path))
    for i, raw in enumerate(frame["raw"]):
        want = ref.classify(frame.loc[i, "text"], dfllm.PoolingParams(use_activation=not raw), use_tqdm=False)[0]
        np.testing.assert_allclose(got.loc[i, "logits"], want.outputs.probs, rtol=1e-5, atol=1e-6)
    assert abs(sum(got.loc[0, "logits"]) - 1) < 1e-5 and abs(sum(got.loc[1, "logits"]) - 1) > 1e-4
    pairs = pd.DataFrame(
        {"q": ["a cat", "a cat"], "d": ["a small kitten sleeping", "a small kitten sleeping"], "cut": [None, 3]}
    )
    scorer = build_processor(
        vLLMEngineProcessorConfig(model_source=None, task_type="score"),
        lambda r: dict(
            text_1=r["q"],
            text_2=r["d"],
            **({} if pd.isna(r["cut"]) else {"pooling_params": {"truncate_prompt_tokens": int(r["cut"])}}),
        ),
    )
    # one partition: the sampled rows (the output's columns, without postprocess the whole row)
    # include the row with pooling_params; a sample without it would make that column a failed row
    scores = run(scorer, pairs, npartitions=1)["score"].tolist()
    minilm = dfllm.LLM("all-minilm-l6-v2")
    assert scores[0] == pytest.approx(minilm.score("a cat", "a small kitten sleeping", use_tqdm=False)[0].outputs.score)
    assert scores[1] == pytest.approx(
        minilm.score(
            "a cat",
            "a small kitten sleeping",
            use_tqdm=False,
            pooling_params=dfllm.PoolingParams(truncate_prompt_tokens=3),
        )[0].outputs.score
    )
    assert scores[0] != pytest.approx(scores[1])


@pytest.mark.slow
def test_guided_decoding_in_sampling_params(tiny_llama):
    """Ray's structured outputs: ``sampling_params={"guided_decoding": {...}}`` (Ray builds
    vLLM's structured outputs params from it), or dfllm/vLLM's ``structured_outputs``."""
    choices = ["yes", "no", "maybe"]
    frame = pd.DataFrame({"q": ["Is it?", "Really?"], "how": ["guided_decoding", "structured_outputs"]})
    processor = build_processor(
        config(tiny_llama),
        lambda r: dict(
            messages=[{"role": "user", "content": r["q"]}],
            # arrays, as list values read back from Arrow columns are (Ray turns them into lists)
            sampling_params={
                "temperature": 0.0,
                "max_tokens": 8,
                "stop": np.array(["\n\n"]),
                r["how"]: {"choice": np.array(choices)},
            },
        ),
        lambda r: dict(answer=r["generated_text"]),
    )
    got = run(processor, frame)
    assert "llm_error" not in got.columns and set(got["answer"]) <= set(choices)
    both = build_processor(
        config(tiny_llama, should_continue_on_error=True),
        lambda r: dict(
            prompt=r["q"],
            sampling_params={"guided_decoding": {"choice": choices}, "structured_outputs": {"choice": choices}},
        ),
    )(frame)
    assert both["__inference_error__"].str.contains("guided_decoding or structured_outputs").all()


@pytest.mark.parametrize("stage", [True, False])
def test_detokenize_false_under_the_detokenize_stage(tiny_llama, llm, stage):
    """Ray's docs: with the detokenize stage on, rows say ``detokenize=False`` and the stage
    decodes ``generated_tokens``; with it off, the engine's (empty) text is what there is."""
    frame = pd.DataFrame({"q": ["Hello world!"]})
    processor = build_processor(
        config(tiny_llama, detokenize_stage=stage),
        lambda r: dict(messages=[{"role": "user", "content": r["q"]}], sampling_params=dict(GREEDY, detokenize=False)),
        lambda r: dict(resp=r["generated_text"], n=len(r["generated_tokens"])),
    )
    got = run(processor, frame, npartitions=1)
    ref = llm.chat([{"role": "user", "content": "Hello world!"}], dfllm.SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert got.loc[0, "n"] == len(ref.outputs[0].token_ids)
    assert got.loc[0, "resp"] == (ref.outputs[0].text if stage else "")
