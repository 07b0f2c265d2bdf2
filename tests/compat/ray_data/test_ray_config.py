"""A Ray Data LLM user's script on a Dask frame, with only the import changed:
``vLLMEngineProcessorConfig`` and ``build_processor`` (or the older ``build_llm_processor``)
from ``dfllm``, Ray's fields accepted with Ray's defaults, its bad values refused, and its
``should_continue_on_error`` modes."""

from __future__ import annotations

import inspect

import dask.dataframe as dd
import pandas as pd
import pytest

import dfllm
from dfllm import build_llm_processor, build_processor, vLLMEngineProcessorConfig
from dfllm.jobs.processor import RowFailedError

SYSTEM = "You are a helpful assistant."
ITEMS = ["Write a haiku about rivers.", "Name a colour.", "Say hello.", "Count to three.", "Pick a fruit."]


def ray_config(model, **fields) -> vLLMEngineProcessorConfig:
    """The config of Ray Data LLM's quickstart, field for field."""
    quickstart = dict(
        model_source=str(model),
        engine_kwargs={"max_model_len": 256},
        concurrency=1,
        batch_size=16,
        chat_template_stage=True,
        tokenize_stage=True,
        detokenize_stage=True,
    )
    return vLLMEngineProcessorConfig(**{**quickstart, **fields})


def preprocess(row):
    return dict(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["item"]}],
        sampling_params=dict(temperature=0.0, max_tokens=8),
    )


def postprocess(row):
    return dict(answer=row["generated_text"], **row)


@pytest.fixture(scope="module")
def items():
    return pd.DataFrame({"item": ITEMS})


@pytest.fixture(scope="module")
def expected(tiny_llama):
    """The answers of vLLM's ``LLM.chat`` API (dfllm's) to the same conversations."""
    llm = dfllm.LLM(str(tiny_llama), max_model_len=256)
    outs = llm.chat(
        [preprocess({"item": i})["messages"] for i in ITEMS],
        dfllm.SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )
    return [o.outputs[0].text for o in outs]


@pytest.mark.slow
def test_ray_quickstart_script_on_dask(tiny_llama, items, expected):
    processor = build_processor(ray_config(tiny_llama), preprocess=preprocess, postprocess=postprocess)
    lazy = processor(dd.from_pandas(items, npartitions=2))
    assert lazy.columns[0] == "answer" and {"item", "messages", "generated_text"} <= set(lazy.columns)
    got = lazy.compute().sort_index()
    assert got["answer"].tolist() == expected and got["item"].tolist() == ITEMS
    assert (got["num_generated_tokens"] <= 8).all()
    assert "llm_error" not in got.columns  # Ray's default: a failed row fails the job, no error column
    timing = ["time_taken_llm"]  # seconds of the engine call: the same columns, not the same values
    pd.testing.assert_frame_equal(got.drop(columns=timing), processor(items).drop(columns=timing))  # on pandas


def test_build_llm_processor_is_build_processor(tiny_llama, items, expected):
    with pytest.warns(DeprecationWarning, match="build_processor"):
        processor = build_llm_processor(ray_config(tiny_llama), preprocess=preprocess, postprocess=postprocess)
    got = processor(dd.from_pandas(items, npartitions=2)).compute().sort_index()
    assert got["answer"].tolist() == expected


def test_build_llm_processor_takes_every_argument_of_build_processor(tiny_llama, tmp_path):
    """The older name passes its arguments through: the same signature, and keyword-only ones
    such as ``cache`` reach the processor (a copied signature had lost ``cache``)."""
    assert inspect.signature(build_llm_processor) == inspect.signature(build_processor)
    kwargs = dict(preprocess=preprocess, postprocess=postprocess, key="answers", cache=str(tmp_path / "cache"))
    with pytest.warns(DeprecationWarning, match="build_processor"):
        old = build_llm_processor(ray_config(tiny_llama), **kwargs)
    new = build_processor(ray_config(tiny_llama), **kwargs)
    assert old.config == new.config and old.config.cache.url == str(tmp_path / "cache")


def long_at(n: int, where: int) -> pd.DataFrame:
    """``n`` rows, the one at ``where`` past max_model_len (an engine error)."""
    return pd.DataFrame({"item": ["x " * 400 if i == where else f"Say {i}." for i in range(n)]})


def test_should_continue_on_error_false_fails_the_job_naming_the_row(tiny_llama):
    processor = build_processor(
        ray_config(tiny_llama, should_continue_on_error=False), preprocess=preprocess, postprocess=postprocess
    )
    lazy = processor(dd.from_pandas(long_at(12, 9), npartitions=3))  # sampled: rows 0-3, all fine
    assert "llm_error" not in lazy.columns and "__inference_error__" not in lazy.columns
    with pytest.raises(RowFailedError, match=r"row 9 failed: .*max_model_len=256") as info:
        lazy.compute()
    assert info.value.row == 9 and "max_model_len" in info.value.error
    with pytest.raises(RowFailedError, match="row 1 failed"):  # a sampled row: at call time
        processor(dd.from_pandas(long_at(6, 1), npartitions=2))
    with pytest.raises(RowFailedError, match="row 2 failed"):  # pandas: now
        processor(long_at(4, 2))
    ok = processor(dd.from_pandas(long_at(4, -1), npartitions=2)).compute()
    assert list(ok.columns) == list(lazy.columns) and ok["answer"].notna().all()


def test_should_continue_on_error_true_keeps_the_row_in_inference_error(tiny_llama):
    seen = []

    def post(row):
        seen.append(row["item"])
        assert row["__inference_error__"] is None and "llm_error" not in row
        return postprocess(row)

    processor = build_processor(
        ray_config(tiny_llama, should_continue_on_error=True), preprocess=preprocess, postprocess=post
    )
    frame = long_at(6, 4)
    for out in (processor(dd.from_pandas(frame, npartitions=2)).compute().sort_index(), processor(frame)):
        assert "llm_error" not in out.columns and out.columns[-1] == "__inference_error__"
        errors = out["__inference_error__"]
        assert "max_model_len=256" in errors[4] and errors.drop(index=4).isna().all()
        assert pd.isna(out.loc[4, "answer"]) and out.loc[4, "item"] == frame.loc[4, "item"]  # bypassed postprocess
        assert out["answer"].drop(index=4).notna().all()
    assert frame.loc[4, "item"] not in seen


def test_chat_template_stage_off_sends_the_prompt(tiny_llama):
    def pre(row):
        return dict(
            prompt=row["item"],
            messages=[{"role": "user", "content": row["item"]}],
            sampling_params=dict(temperature=0.0, max_tokens=4),
        )

    frame = pd.DataFrame({"item": ["Once upon a time"]})
    config = vLLMEngineProcessorConfig(
        model_source=str(tiny_llama),
        engine_kwargs={"max_model_len": 256},
        chat_template_stage={"enabled": False},
        tokenize_stage={"enabled": False, "batch_size": 8},
        detokenize_stage=False,
    )
    off = build_processor(config, preprocess=pre)(frame)
    assert off.loc[0, "num_input_tokens"] < 10  # the bare prompt, no template around it
    llm = dfllm.LLM(str(tiny_llama), max_model_len=256)
    ref = llm.generate(["Once upon a time"], dfllm.SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert off.loc[0, "generated_text"] == ref[0].outputs[0].text
    legacy = vLLMEngineProcessorConfig(
        model_source=str(tiny_llama), apply_chat_template=False, tokenize=False, detokenize=False
    )
    assert legacy.apply_chat_template is False


def test_ray_fields_accepted(tiny_llama):
    config = ray_config(
        tiny_llama,
        accelerator_type="H100",
        runtime_env={"pip": []},
        placement_group_config={},
        resources_per_bundle={"GPU": 1},
        max_concurrent_batches=4,
        max_tasks_in_flight_per_actor=8,
        max_pending_requests=64,
        log_engine_metrics=False,
        dynamic_lora_loading_path=None,
        prepare_multimodal_stage=False,
        prepare_image_stage={"enabled": False},
        has_image=False,
        chat_template_kwargs={},
        concurrency=(1, 4),
    )
    assert config.concurrency == (1, 4) and config.task_resources() == {"accelerator_type:H100": 0.001}
    assert vLLMEngineProcessorConfig().batch_size == 32


def test_ray_defaults_on_rays_class_dfllms_on_processor_config():
    """Ray's class has Ray's defaults (``should_continue_on_error=False``, as in Ray Data
    LLM); ``ProcessorConfig``, dfllm's subclass, keeps dfllm's (None: rows kept in
    ``llm_error``); the stage configs have Ray's (on, nothing else set)."""
    ray, ours = vLLMEngineProcessorConfig(), dfllm.ProcessorConfig()
    assert ray.should_continue_on_error is False and ray.error_column is None
    assert ours.should_continue_on_error is None and ours.error_column == "llm_error"
    assert isinstance(ours, vLLMEngineProcessorConfig) and type(ray) is vLLMEngineProcessorConfig
    other = {f: getattr(ray, f) for f in vLLMEngineProcessorConfig.__dataclass_fields__}
    assert {**other, "should_continue_on_error": None} == {f: getattr(ours, f) for f in other}  # only that differs
    assert dict(
        batch_size=32,
        concurrency=1,
        task_type="generate",
        apply_chat_template=True,
        tokenize=True,
        detokenize=True,
        has_image=False,
        max_concurrent_batches=8,
        log_engine_metrics=True,
        accelerator_type=None,
    ) == {
        k: getattr(ray, k)
        for k in (
            "batch_size",
            "concurrency",
            "task_type",
            "apply_chat_template",
            "tokenize",
            "detokenize",
            "has_image",
            "max_concurrent_batches",
            "log_engine_metrics",
            "accelerator_type",
        )
    }
    for stage in (
        dfllm.ChatTemplateStageConfig,
        dfllm.TokenizerStageConfig,
        dfllm.DetokenizeStageConfig,
        dfllm.PrepareMultimodalStageConfig,
        dfllm.PrepareImageStageConfig,
    ):
        assert stage().settings() == {"enabled": True}


def test_a_bad_row_fails_the_job_with_rays_class_and_is_kept_with_processor_config(tiny_llama):
    """The same fields, without ``should_continue_on_error``: Ray's class fails the job on
    the row past max_model_len (as Ray does), dfllm's keeps it, with its ``llm_error``."""
    fields = dict(model_source=str(tiny_llama), engine_kwargs={"max_model_len": 256}, batch_size=16)
    frame = long_at(6, 4)
    ray = build_processor(vLLMEngineProcessorConfig(**fields), preprocess=preprocess, postprocess=postprocess)
    lazy = ray(dd.from_pandas(frame, npartitions=2))  # sampled: rows 0-2, all fine
    assert "llm_error" not in lazy.columns
    with pytest.raises(RowFailedError, match=r"row 4 failed: .*max_model_len=256"):
        lazy.compute()
    with pytest.raises(RowFailedError, match="row 4 failed"):
        ray(frame)
    ours = build_processor(dfllm.ProcessorConfig(**fields), preprocess=preprocess, postprocess=postprocess)
    for out in (ours(dd.from_pandas(frame, npartitions=2)).compute().sort_index(), ours(frame)):
        assert out.columns[-1] == "llm_error" and "max_model_len=256" in out.loc[4, "llm_error"]
        assert out["llm_error"].drop(index=4).isna().all() and out["answer"].drop(index=4).notna().all()
        assert out.loc[4, "item"] == frame.loc[4, "item"] and pd.isna(out.loc[4, "answer"])


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(concurrency=0), "concurrency"),
        (dict(concurrency=-2), "concurrency"),
        (dict(concurrency=(3, 1)), "concurrency"),
        (dict(prepare_image_stage={"enabled": True, "nope": 1}), "unknown key"),
        (dict(chat_template_stage="yes"), "chat_template_stage"),
        (dict(tokenize_stage={"enabled": True, "nope": 1}), "unknown key"),
        (dict(max_concurrent_batches=0), "max_conc"),
        (dict(max_pending_requests=0), "max_pending"),
        (dict(dynamic_lora_loading_path=""), "dynamic_lora_loading_path"),
        (dict(should_continue_on_error="no"), "should_continue"),
        (dict(chat_template_kwargs={1: True}), "chat_template_kwargs"),
        (dict(chat_template_kwargs=["x"]), "kwargs"),
        (dict(batch_size=0), "batch_size"),
    ],
)
def test_bad_values_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        vLLMEngineProcessorConfig(model_source="x", **fields)


@pytest.mark.slow
def test_accelerator_type_places_the_engine_on_workers_declaring_it(tiny_llama, items, expected):
    """Ray's ``accelerator_type`` on a mixed Dask cluster: only the worker declaring
    ``accelerator_type:H100`` loads the model, whatever worker a partition started on."""
    from distributed import Client, Nanny, Scheduler, SpecCluster

    from dfllm.worker import engine_cache

    workers = {
        "cpu": {"cls": Nanny, "options": {"nthreads": 2}},
        "h100": {"cls": Nanny, "options": {"nthreads": 2, "resources": {"accelerator_type:H100": 1}}},
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        processor = build_processor(
            ray_config(tiny_llama, accelerator_type="H100"), preprocess=preprocess, postprocess=postprocess
        )
        got = processor(dd.from_pandas(items, npartitions=5)).compute().sort_index()
        assert got["answer"].tolist() == expected
        info = client.scheduler_info(n_workers=-1)["workers"]
        loads = client.run(engine_cache.load_count)
        assert sorted((bool(info[a].get("resources")), n) for a, n in loads.items()) == [(False, 0), (True, 1)]
