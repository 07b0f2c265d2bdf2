"""Ray Data LLM's "Working with LLMs" examples (``doc/source/data/working-with-llms`` and its
``doc_code``), those that need no images, HTTP endpoint or LoRA adapter, written the way
a Ray user writes them: the same config fields, the same preprocess/postprocess shapes and
the same fields read, with only the import changed, on a Dask frame and the tiny test
models (``map_batches`` stages become ``map_partitions``)."""

from __future__ import annotations

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import dfllm
from dfllm import build_llm_processor, build_processor, vLLMEngineProcessorConfig
from dfllm.jobs.ray_config import DetokenizeStageConfig, TokenizerStageConfig

ITEMS = ["Start of the haiku is: Complete this for me...", "Hello world!"]


def dask(rows: list[dict], npartitions: int = 2) -> dd.DataFrame:
    """``ray.data.from_items(rows)``, on Dask: Arrow-typed columns, as Ray's blocks are."""
    return dd.from_pandas(pa.Table.from_pylist(rows).to_pandas(types_mapper=pd.ArrowDtype), npartitions=npartitions)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return dfllm.LLM(str(tiny_llama), max_model_len=256)


def test_minimal_quickstart(tiny_llama, llm):
    """``minimal_quickstart.py``: prompts in, chat messages out of preprocess, ``prompt`` and
    ``response`` read back (``iter_rows`` there; the frame's rows here)."""
    config = vLLMEngineProcessorConfig(
        model_source=str(tiny_llama), concurrency=1, batch_size=32, engine_kwargs={"max_model_len": 256}
    )
    processor = build_processor(
        config,
        preprocess=lambda row: {
            "messages": [{"role": "user", "content": row["prompt"]}],
            "sampling_params": {"temperature": 0.0, "max_tokens": 6},
        },
        postprocess=lambda row: {
            "prompt": row["prompt"],
            "response": row["generated_text"],
        },
    )
    questions = ["What is machine learning?", "Explain neural networks in one sentence."]
    ds = processor(dask([{"prompt": q} for q in questions]))
    results = ds.compute().sort_index()
    refs = llm.chat(
        [[{"role": "user", "content": q}] for q in questions],
        dfllm.SamplingParams(temperature=0.0, max_tokens=6),
        use_tqdm=False,
    )
    for result, q, ref in zip(results.to_dict("records"), questions, refs):
        assert q in result["prompt"] and result["prompt"] == ref.prompt  # the prompt sent, as in Ray
        assert result["response"] == ref.outputs[0].text


@pytest.mark.slow
def test_embedding_example(tmp_path):
    """``embedding_example.py`` (and the embedding config of ``basic_llm_example.py``):
    the older ``build_llm_processor``, stages off, ``row["embeddings"]`` read."""
    embedding_config = vLLMEngineProcessorConfig(
        model_source="all-minilm-l6-v2",  # Ray: "sentence-transformers/all-MiniLM-L6-v2", bundled here
        task_type="embed",
        engine_kwargs=dict(
            enable_prefix_caching=False, enable_chunked_prefill=False, max_model_len=256, enforce_eager=True
        ),
        batch_size=32,
        concurrency=1,
        chat_template_stage=False,  # Skip chat templating for embeddings
        detokenize_stage=False,  # Skip detokenization for embeddings
    )
    with pytest.warns(DeprecationWarning):
        embedding_processor = build_llm_processor(
            embedding_config,
            preprocess=lambda row: dict(prompt=row["text"]),
            postprocess=lambda row: {
                "text": row["prompt"],
                "embedding": row["embeddings"],
            },
        )
    texts = ["Hello world", "This is a test sentence", "Embedding models convert text to vectors"]
    embedded = embedding_processor(dask([{"text": t} for t in texts])).compute().sort_index()
    assert embedded["text"].tolist() == texts and "llm_error" not in embedded.columns  # Ray's default
    refs = dfllm.LLM("all-minilm-l6-v2").embed(texts, use_tqdm=False)
    for got, ref in zip(embedded["embedding"], refs):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref.outputs.embedding), rtol=1e-5, atol=1e-6)
    # the legacy flags of basic_llm_example.py's embedding config: the same processor
    legacy = vLLMEngineProcessorConfig(
        model_source="all-minilm-l6-v2",
        task_type="embed",
        batch_size=32,
        concurrency=1,
        apply_chat_template=False,
        detokenize=False,
    )
    again = build_processor(
        legacy,
        preprocess=lambda row: dict(prompt=row["text"]),
        postprocess=lambda row: {"text": row["prompt"], "embedding": row["embeddings"]},
    )
    pd.testing.assert_frame_equal(again(dask([{"text": t} for t in texts])).compute().sort_index(), embedded)


def test_classification_example(tmp_path):
    """``classification_example.py``: a sequence classifier, its scores read from
    ``row["embeddings"]``, with the example's guard for a missing value."""
    from helpers import build_tiny_classifier

    classification_config = vLLMEngineProcessorConfig(
        model_source=str(build_tiny_classifier(tmp_path)),
        task_type="classify",  # Use 'classify' for sequence classification models
        engine_kwargs=dict(max_model_len=128, enforce_eager=True),  # Ray: 512; the tiny model has 128 positions
        batch_size=8,
        concurrency=1,
        apply_chat_template=False,
        detokenize=False,
    )
    classification_processor = build_processor(
        classification_config,
        preprocess=lambda row: dict(prompt=row["text"]),
        postprocess=lambda row: {
            "text": row["prompt"],
            "edu_score": float(row["embeddings"][0])
            if row.get("embeddings") is not None and len(row["embeddings"]) > 0
            else None,
        },
    )
    texts = [
        "lol that was so funny haha",
        "Photosynthesis converts light energy into chemical energy.",
        "Newton's laws describe the relationship between forces and motion.",
    ]
    classified = classification_processor(dask([{"text": t} for t in texts])).compute().sort_index()
    refs = dfllm.LLM(classification_config.model_source).classify(texts, use_tqdm=False)
    assert classified["text"].tolist() == texts
    assert classified["edu_score"].tolist() == pytest.approx([r.outputs.probs[0] for r in refs], rel=1e-5)


@pytest.mark.parametrize("disaggregated", [True, False])
def test_tokenization_examples(tiny_llama, llm, disaggregated):
    """``tokenization_disaggregation_example.py`` (stages on, ``detokenize=False`` in the
    sampling params: the detokenize stage decodes) and ``tokenization_aggregation_example.py``
    (stage config classes with ``enabled=False``, ``detokenize=True``: the engine decodes)."""
    stages = (
        dict(tokenize_stage=True, detokenize_stage=True)
        if disaggregated
        else dict(
            tokenize_stage=TokenizerStageConfig(enabled=False), detokenize_stage=DetokenizeStageConfig(enabled=False)
        )
    )
    config = vLLMEngineProcessorConfig(
        model_source=str(tiny_llama), engine_kwargs={"max_model_len": 256}, concurrency=1, batch_size=64, **stages
    )
    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            messages=[{"role": "user", "content": row["item"]}],
            sampling_params=dict(temperature=0.0, max_tokens=6, detokenize=not disaggregated),
        ),
        postprocess=lambda row: dict(resp=row["generated_text"]),
    )
    ds = processor(dask([{"item": "Hello world!"}], npartitions=1)).compute()
    ref = llm.chat(
        [{"role": "user", "content": "Hello world!"}],
        dfllm.SamplingParams(temperature=0.0, max_tokens=6),
        use_tqdm=False,
    )[0]
    assert ds["resp"].tolist() == [ref.outputs[0].text] and ref.outputs[0].text


@pytest.mark.slow
def test_custom_tokenizer_pipeline(tiny_llama, llm):
    """``custom_tokenizer_example.py``: the built-in stages off, chat template and
    tokenization done by the user's own batch functions before the processor (rows carry
    ``prompt``, ``messages``, ``tokenized_prompt``, ``sampling_params``), and the
    generated tokens decoded after it."""
    tokenizer = llm.get_tokenizer()

    def chat_template(batch: pd.DataFrame) -> pd.DataFrame:  # VLLMChatTemplate.__call__
        prompts = []
        for messages in batch["messages"]:
            if hasattr(messages, "tolist"):
                messages = messages.tolist()
            add_generation_prompt = messages[-1]["role"] == "user"
            prompts.append(
                tokenizer.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=not add_generation_prompt,
                )
            )
        return pd.DataFrame(
            {"prompt": prompts, "messages": batch["messages"], "sampling_params": batch["sampling_params"]},
            index=batch.index,
        )

    def tokenize(batch: pd.DataFrame) -> pd.DataFrame:  # VLLMTokenize.__call__
        return pd.DataFrame(
            {
                "tokenized_prompt": [tokenizer.encode(p) for p in batch["prompt"]],
                "messages": batch["messages"],
                "sampling_params": batch["sampling_params"],
            },
            index=batch.index,
        )

    def detokenize(batch: pd.DataFrame) -> pd.DataFrame:  # VLLMDetokenize.__call__
        decoded = [tokenizer.decode(list(tokens), skip_special_tokens=True) for tokens in batch["generated_tokens"]]
        return batch.assign(generated_text_custom=pd.Series(decoded, index=batch.index, dtype="string[pyarrow]"))

    rows = [
        {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "sampling_params": {"max_tokens": 6, "temperature": 0.0},
        },
        {
            "messages": [{"role": "user", "content": "Write a haiku about computing."}],
            "sampling_params": {"max_tokens": 6, "temperature": 0.0},
        },
    ]
    # Ray's example also sets trust_remote_code=True, which dfllm refuses (it never runs remote code)
    config = vLLMEngineProcessorConfig(
        model_source=str(tiny_llama),
        engine_kwargs=dict(max_model_len=256, tokenizer_mode="auto"),
        batch_size=4,
        concurrency=1,
        chat_template_stage=False,
        tokenize_stage=False,
        detokenize_stage=False,
    )
    processor = build_processor(
        config,
        postprocess=lambda row: {
            "generated_text": row.get("generated_text", ""),
            "generated_tokens": row.get("generated_tokens", []),
            "num_input_tokens": row.get("num_input_tokens", 0),
            "num_generated_tokens": row.get("num_generated_tokens", 0),
        },
    )
    ds = dask(rows)
    ds = ds.map_partitions(
        chat_template, meta=pd.DataFrame({"prompt": pd.Series([], dtype=str), "messages": [], "sampling_params": []})
    )
    ds = ds.map_partitions(tokenize, meta=pd.DataFrame({"tokenized_prompt": [], "messages": [], "sampling_params": []}))
    ds = processor(ds)
    ds = ds.map_partitions(
        detokenize, meta=ds._meta.assign(generated_text_custom=pd.Series([], dtype="string[pyarrow]"))
    )
    got = ds.compute().sort_index()
    refs = llm.chat([r["messages"] for r in rows], dfllm.SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert "llm_error" not in got.columns  # Ray's default: a failed row fails the job, no error column
    for (_, row), ref in zip(got.iterrows(), refs):
        assert row["generated_text"] == ref.outputs[0].text == row["generated_text_custom"]
        assert list(row["generated_tokens"]) == list(ref.outputs[0].token_ids)
        assert row["num_input_tokens"] == len(ref.prompt_token_ids)


@pytest.mark.slow
def test_scaling_and_tuning_configs(tiny_llama, llm):
    """The configs of "Scaling", "Per-stage configuration", "Tuning concurrent batch
    processing" and "GPU memory and CUDA OOM" (``basic_llm_example.py``): accepted as
    written, the Ray-cluster knobs inert on Dask, and the rows the same."""

    def preprocess(row):
        return dict(
            messages=[
                {"role": "system", "content": "You are a bot that responds with haikus."},
                {"role": "user", "content": row["item"]},
            ],
            sampling_params=dict(temperature=0.0, max_tokens=4),
        )

    configs = [
        dict(concurrency=4, batch_size=64),  # autoscaling 1..4 replicas
        dict(concurrency=(4, 4), batch_size=64),  # a fixed pool
        dict(
            chat_template_stage={"enabled": True, "batch_size": 256, "concurrency": 4},
            tokenize_stage={"enabled": True, "batch_size": 512, "num_cpus": 0.5},
            detokenize_stage={"enabled": True, "concurrency": (2, 8)},
        ),
        dict(max_concurrent_batches=16, experimental={"max_tasks_in_flight_per_actor": 32}, batch_size=16),
        dict(
            engine_kwargs={
                "max_model_len": 256,
                "max_num_batched_tokens": 2048,
                "enable_chunked_prefill": True,
                "block_size": 16,
            },
            batch_size=16,
        ),
    ]
    ref = llm.chat(
        [preprocess({"item": i})["messages"] for i in ITEMS],
        dfllm.SamplingParams(temperature=0.0, max_tokens=4),
        use_tqdm=False,
    )
    for fields in configs:
        config = vLLMEngineProcessorConfig(
            model_source=str(tiny_llama), **{"engine_kwargs": {"max_model_len": 256}, **fields}
        )
        processor = build_processor(
            config, preprocess=preprocess, postprocess=lambda row: dict(answer=row["generated_text"], **row)
        )
        got = processor(dask([{"item": i} for i in ITEMS])).compute().sort_index()
        assert got["answer"].tolist() == [r.outputs[0].text for r in ref], fields
    assert (
        vLLMEngineProcessorConfig(
            model_source=str(tiny_llama), experimental={"max_tasks_in_flight_per_actor": 32}
        ).max_tasks_in_flight_per_actor
        == 32
    )
    with pytest.raises(ValueError, match="experimental"):
        vLLMEngineProcessorConfig(model_source=str(tiny_llama), experimental={"nope": 1})


def test_row_level_fault_tolerance_example(tiny_llama):
    """ "Continue processing after row failures": ``should_continue_on_error=True``, a prompt
    past ``max_model_len`` is its row's ``__inference_error__`` and the job goes on."""
    config = vLLMEngineProcessorConfig(
        model_source=str(tiny_llama),
        engine_kwargs={"max_model_len": 256},
        should_continue_on_error=True,
        batch_size=64,
        concurrency=1,
    )
    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            messages=[{"role": "user", "content": row["item"]}], sampling_params=dict(temperature=0.0, max_tokens=4)
        ),
        postprocess=lambda row: dict(resp=row["generated_text"], item=row["item"]),
    )
    got = processor(dask([{"item": "ok"}, {"item": "word " * 400}, {"item": "fine"}], npartitions=1)).compute()
    errors = got["__inference_error__"]
    assert errors.notna().tolist() == [False, True, False] and "max_model_len" in errors[1]
    assert got["item"].tolist()[1] == "word " * 400 and got["resp"].notna().tolist() == [True, False, True]
