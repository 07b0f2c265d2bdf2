"""A dry run's counters equal a real run's on LoRA, image and reasoning jobs.

The dry run asks the engine's own functions which requests are computed once
(:func:`dfllm.engine.dedupe.dedupe_key`) and which prompt blocks the prefix cache shares
(:func:`dfllm.engine.prefix_hash.prefix_block_hashes`), with each row's adapter, images and
reasoning parser. So on one partition run one request at a time (``max_num_seqs=1``: each
request's blocks are in the cache before the next one looks), its ``duplicates`` equal the
engine's ``deduplicated`` counter and its ``prefix_cached_tokens`` the engine's prefix-cache
hits, whatever the kind of job. The rows are chosen so that a dry run keying on prompt tokens
alone would count more: the same prompt under two adapters, or with two images.
"""

from __future__ import annotations

from pathlib import Path

import dask
import dask.dataframe as dd
import pandas as pd
import pytest

import dfllm.accessors.pandas_ext  # noqa: F401  (registers .llm)
from dfllm.jobs.dry_run import dry_run
from dfllm.worker import engine_cache

from helpers import make_adapter
from image_data import png_bytes, random_image

pytestmark = pytest.mark.timeout(600)

GREEDY = {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}
LONG = "Read the following note about rivers, lakes and the sea before you answer the question after it."
SERIAL = {"max_num_seqs": 1, "max_model_len": 256, "kv_cache_memory_bytes": 1 << 23}


def counters(model: str, engine_kwargs: dict) -> tuple[int, int]:
    """The ``deduplicated`` and prefix-cache hit counters of this process's engine for ``model``."""
    metrics = engine_cache.get_engine(model, engine_kwargs).engine.metrics
    return int(metrics.deduplicated._value.get()), int(metrics.prefix_hits._value.get())


def compare(df: pd.DataFrame, method: str, model: str, engine_kwargs: dict, **kw) -> tuple[int, int]:
    """The dry run's (duplicates, prefix-cached tokens) of one partition, asserted equal to a real
    run's engine counters; returned for the caller's own checks."""
    with dask.config.set({"dataframe.convert-string": False}):  # an image column stays bytes
        ddf = dd.from_pandas(df, npartitions=1)
    job = getattr(ddf.llm, method)
    report = dry_run(job("{q}", model=model, sampling_params=GREEDY, **engine_kwargs, **kw), sample_rows=0)
    assert report.refused == 0, [r.examples for r in report.refusals]
    dedupe, hits = counters(model, report_kwargs := _engine_kwargs(engine_kwargs, kw))
    out = getattr(df.llm, method)("{q}", model=model, sampling_params=GREEDY, **engine_kwargs, **kw)
    assert out["llm_error"].isna().all(), list(out["llm_error"])
    after = counters(model, report_kwargs)
    assert (report.duplicates, report.prefix_cached_tokens) == (after[0] - dedupe, after[1] - hits)
    return report.duplicates, report.prefix_cached_tokens


def _engine_kwargs(engine_kwargs: dict, kw: dict) -> dict:
    """The engine arguments the dataframe methods load the engine with (a LoRA column adds
    the adapter settings, as :func:`dfllm.tasks.task.make_task` does)."""
    if "lora" not in kw:
        return dict(engine_kwargs)
    from dfllm.engine_args import DATAFRAME_MAX_CPU_LORAS, DATAFRAME_MAX_LORAS

    return {
        **engine_kwargs,
        "enable_lora": True,
        "max_loras": DATAFRAME_MAX_LORAS,
        "max_cpu_loras": DATAFRAME_MAX_CPU_LORAS,
    }


@pytest.mark.slow
def test_lora_job(tiny_llama, tmp_path):
    a = make_adapter(tiny_llama, tmp_path / "a", 1, 4, ["q_proj", "v_proj"])
    b = make_adapter(tiny_llama, tmp_path / "b", 2, 4, ["q_proj", "v_proj"])
    q = f"{LONG} Which river is the longest?"
    df = pd.DataFrame(
        {
            "q": [q, q, q, q, q, f"{q} And the widest?"],
            "adapter": [str(a), str(a), str(b), None, None, str(a)],
        }
    )
    duplicates, cached = compare(df, "generate", str(tiny_llama), SERIAL, lora="adapter")
    # one copy each under adapter a and the base model; b shares nothing with them; the last
    # row shares its prompt's leading blocks with a's
    assert duplicates == 2 and cached > 0


@pytest.mark.slow
def test_image_job(llava_dir):  # noqa: F811
    x, y = png_bytes(random_image(1, (40, 30))), png_bytes(random_image(2, (30, 40)))
    df = pd.DataFrame({"q": ["Describe it, please."] * 4, "img": pd.Series([x, x, y, y], dtype=object)})
    kw = {**SERIAL, "limit_mm_per_prompt": {"image": 1}}
    duplicates, _ = compare(df.assign(q="<image>\n" + df["q"]), "generate", str(llava_dir), kw, images="img")
    assert duplicates == 2  # the same prompt with another image is another request


@pytest.mark.slow
def test_reasoning_job(thinker):  # noqa: F811
    df = pd.DataFrame({"q": ["Capital of France?", "Capital of France?", "Capital of Spain?"]})
    duplicates, cached = compare(df, "chat", str(thinker), {**SERIAL, "reasoning_parser": "qwen3"})
    assert duplicates == 1 and cached >= 0


def test_the_dry_run_keys_on_the_engines_functions():
    """Two requests differing only in their adapter: the dry run's digest and block chain tell
    them apart, as the engine's key and prefix cache do."""
    from dfllm.engine.dedupe import dedupe_digest, dedupe_key
    from dfllm.engine.input_processor import EngineRequest
    from dfllm.jobs.dry_run import block_digests
    from dfllm.lora.request import LoRARequest
    from dfllm.sampling_params import SamplingParams

    ids = list(range(40))
    base = EngineRequest("p", ids, SamplingParams(temperature=0.0))
    lora = EngineRequest("p", ids, SamplingParams(temperature=0.0), lora_request=LoRARequest("a", 1, Path("/a")))
    assert dedupe_key(base) != dedupe_key(lora) and dedupe_digest(base) != dedupe_digest(lora)
    assert dedupe_digest(base) == dedupe_digest(EngineRequest("q", ids, SamplingParams(temperature=0.0)))
    assert set(block_digests(ids, 16)).isdisjoint(block_digests(ids, 16, lora_int_id=1))
    assert dedupe_key(EngineRequest("p", ids, SamplingParams(temperature=1.0))) is None
