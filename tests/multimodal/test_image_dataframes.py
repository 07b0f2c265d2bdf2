"""Image columns on the dataframe accessors (``images=`` on ``generate``, ``chat`` and
``embed``): bytes from a real parquet file, paths, PIL images; decoded on the workers only;
broken, mistyped and too many images as row errors while every other row is answered; rows
equal to what ``LLM`` (and transformers) give for the same image; Dask on a LocalCluster of
worker processes, pandas and Polars."""

from __future__ import annotations

from pathlib import Path

import dask.dataframe as dd
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import (
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

import dfllm.accessors.pandas_ext  # noqa: F401  (registers .llm)
import dfllm.accessors.polars_ext  # noqa: F401
from dfllm import LLM, SamplingParams
from dfllm.worker import engine_cache

from helpers import local_client
from image_data import build_tiny_clip, png_bytes, random_image

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    return build_tiny_clip(tmp_path_factory.mktemp("clip"), "clip")


def hf_llava_greedy(path: Path, prompt: str, images: list, n: int = 6) -> list[int]:
    """transformers' own greedy generate for one prompt and its images."""
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    proc = LlavaProcessor.from_pretrained(path, backend="pil")
    inputs = proc(text=prompt, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


# ---- embed ----------------------------------------------------------------------------------------------
def _embed_cells(tmp_path: Path) -> tuple[list, list[str | None]]:
    """An image column's cells and, per row, the error expected (None: an embedding)."""
    a, b = random_image(1, (40, 30)), random_image(2, (64, 64))
    file = tmp_path / "b.jpg"
    b.save(file, format="JPEG")
    cells = [png_bytes(a), str(file), b"\x89PNG not really", None, png_bytes(a), a, 7, [png_bytes(a)] * 2]
    errors = [None, None, "cannot decode image", "is null", None, None, "type int", "has 2 images"]
    return cells, errors


def test_embed_images_pandas_and_polars(clip_dir, tmp_path):
    cells, errors = _embed_cells(tmp_path)
    df = pd.DataFrame({"id": range(len(cells)), "img": pd.Series(cells, dtype=object)})
    out = df.llm.embed(images="img", model=str(clip_dir), on_error="null")
    assert list(out["id"]) == list(range(len(cells)))  # every row once, in order
    llm = engine_cache.get_engine(str(clip_dir), {})
    for i, (cell, err) in enumerate(zip(cells, errors)):
        if err is None:
            want = llm.embed({"multi_modal_data": {"image": cell}}, use_tqdm=False)[0].outputs.embedding
            assert pd.isna(out["llm_error"][i])
            assert out["embedding"][i] == pytest.approx(want, abs=1e-5)
        else:
            assert err in out["llm_error"][i] and "images column 'img'" in out["llm_error"][i]
            assert out["embedding"][i] is None or pd.isna(out["embedding"][i])
    # rows 0, 4 and 5 hold one image: its features are computed once (the engine's cache)
    stats = llm.pooling_engine.image_stats
    assert stats["reused"] >= 2
    # Polars: a Binary column (null: the row's error)
    pf = pl.DataFrame({"img": pl.Series([png_bytes(random_image(3)), None, b"nope"], dtype=pl.Binary)})
    pout = pf.llm.embed(images="img", model=str(clip_dir))
    assert pout["embedding"][0] is not None and pout["llm_error"][0] is None
    assert "is null" in pout["llm_error"][1] and "cannot decode" in pout["llm_error"][2]


def test_images_argument_checked_at_call_time(clip_dir):
    df = pd.DataFrame({"t": ["x"], "img": [b""]})
    with pytest.raises(ValueError, match="not both"):
        df.llm.embed("t", images="img", model=str(clip_dir))
    with pytest.raises(ValueError, match="must name a column"):
        df.llm.embed(images="nope", model=str(clip_dir))
    with pytest.raises(ValueError, match="classify takes no images"):
        df.llm._call("classify", ("t",), None, output_column="label", model=str(clip_dir), images="img")
    with pytest.raises(ValueError, match="needs a text column"):
        df.llm.embed(model=str(clip_dir))


# ---- generate and chat (LLaVA) ----------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_and_chat_with_image_columns_equal_transformers(llava_dir):
    a, b = random_image(11, (48, 32)), random_image(12, (20, 60))
    cells = [png_bytes(a), None, png_bytes(b), b"broken", png_bytes(a), [png_bytes(a), png_bytes(b)]]
    df = pd.DataFrame(
        {"q": ["Describe:", "Hello there", "What is it?", "x", "Again:", "Two:"], "img": pd.Series(cells, dtype=object)}
    )
    kw = dict(model=str(llava_dir), max_model_len=256, limit_mm_per_prompt={"image": 1})
    out = df.llm.generate("<image>\n{q}", images="img", sampling_params=GREEDY, engine_columns="generated_tokens", **kw)
    # a text-only row (null image) has no placeholder to fill: its prompt has none
    text_row = (
        df.assign(img=None)
        .iloc[[1]]
        .llm.generate("{q}", images="img", sampling_params=GREEDY, engine_columns="generated_tokens", **kw)
    )
    assert pd.isna(text_row["llm_error"].iloc[0])
    assert "cannot decode image" in out["llm_error"][3]
    assert "has 2 images" in out["llm_error"][5]
    for i, im in ((0, a), (2, b), (4, a)):
        assert pd.isna(out["llm_error"][i]), out["llm_error"][i]
        assert list(out["generated_tokens"][i]) == hf_llava_greedy(llava_dir, f"<image>\n{df.q[i]}", [im])
    # the image decides the output: the same prompt with the other image generates other tokens
    assert hf_llava_greedy(llava_dir, "<image>\nDescribe:", [b]) != list(out["generated_tokens"][0])
    # chat: the images go first into the user turn, rendered with the model's placeholders
    chat = df.iloc[[0, 2, 3]].llm.chat(
        "{q}", images="img", sampling_params=GREEDY, engine_columns="generated_tokens", **kw
    )
    llm = engine_cache.get_engine(str(llava_dir), {"max_model_len": 256, "limit_mm_per_prompt": {"image": 1}})
    for row, im in ((0, a), (1, b)):
        want = (
            llm.chat(
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_pil", "image_pil": im},
                            {"type": "text", "text": df.q.iloc[[0, 2][row]]},
                        ],
                    }
                ],
                GREEDY,
                use_tqdm=False,
            )[0]
            .outputs[0]
            .token_ids
        )
        assert list(chat["generated_tokens"].iloc[row]) == list(want)
    assert "cannot decode image" in chat["llm_error"].iloc[2]


# ---- Dask, from a real parquet file, on worker processes ---------------------------------------------------
@pytest.fixture(scope="module")
def client():
    with local_client(workers=2, threads=1) as c:
        yield c


@pytest.fixture
def image_parquet(tmp_path, monkeypatch):
    """A parquet file with a large_binary image column (two images repeated, a null, a
    broken one), and a client process where decoding an image fails the test."""
    a, b = random_image(21, (50, 40)), random_image(22, (33, 33))
    cells = [png_bytes(a), png_bytes(b), None, b"garbage", png_bytes(a), png_bytes(b), png_bytes(a), png_bytes(a)]
    table = pa.table(
        {
            "id": pa.array(range(len(cells)), pa.int64()),
            "q": ["Describe:"] * len(cells),
            "img": pa.array(cells, pa.large_binary()),
        }
    )
    pq.write_table(table, tmp_path / "images.parquet", row_group_size=4)

    def no_decoding_here(value):
        raise AssertionError("an image was decoded on the client")

    import dfllm.multimodal

    monkeypatch.setattr(dfllm.multimodal, "load_image", no_decoding_here)  # this process only, not the workers
    return tmp_path / "images.parquet", {0: a, 1: b, 4: a, 5: b, 6: a, 7: a}


@pytest.mark.slow
def test_dask_parquet_image_embeddings_decoded_on_workers(client, clip_dir, image_parquet, monkeypatch):
    path, images = image_parquet
    ddf = dd.read_parquet(path).repartition(npartitions=2)
    emb = ddf.llm.embed(images="img", model=str(clip_dir))
    assert list(emb._meta.columns) == ["id", "q", "img", "embedding", "llm_error"]  # lazy: nothing ran yet
    e = emb.compute().sort_values("id").reset_index(drop=True)
    stats = client.run(
        lambda: [llm.pooling_engine.image_stats for llm in engine_cache.engines() if llm.pooling_engine is not None]
    )
    monkeypatch.undo()  # the references below decode here
    assert list(e["id"]) == list(range(8))
    assert "is null" in e["llm_error"][2] and "cannot decode image" in e["llm_error"][3]
    llm = LLM(model=clip_dir, runner="pooling")
    for i, im in images.items():
        want = llm.embed({"multi_modal_data": {"image": im}}, use_tqdm=False)[0].outputs.embedding
        assert e["embedding"][i] == pytest.approx(want, abs=1e-5)
        assert pd.isna(e["llm_error"][i])
    # 6 image rows of 2 distinct images: each worker encodes each image it sees once
    encoded = sum(s["encoded"] for per_worker in stats.values() for s in per_worker)
    reused = sum(s["reused"] for per_worker in stats.values() for s in per_worker)
    assert encoded <= 2 * len(stats) and encoded + reused == 6


@pytest.mark.slow
def test_dask_parquet_image_captions_equal_transformers(client, llava_dir, image_parquet, monkeypatch):
    path, images = image_parquet
    ddf = dd.read_parquet(path).repartition(npartitions=2)
    gen = ddf.llm.generate(
        "<image>\n{q}",
        images="img",
        model=str(llava_dir),
        max_model_len=256,
        sampling_params=GREEDY,
        engine_columns="generated_tokens",
    )
    g = gen.compute().sort_values("id").reset_index(drop=True)
    monkeypatch.undo()
    assert list(g["id"]) == list(range(8))
    assert "cannot decode image" in g["llm_error"][3]
    # a null image: a row without images, whose prompt still has its placeholder: the row's error
    assert "placeholder" in g["llm_error"][2]
    want = {k: hf_llava_greedy(llava_dir, "<image>\nDescribe:", [im]) for k, im in images.items() if k < 2}
    for i, im in images.items():
        assert pd.isna(g["llm_error"][i]), g["llm_error"][i]
        assert list(g["generated_tokens"][i]) == want[0 if im is images[0] else 1]


# ---- Ray Data LLM's processor and dfllm run ------------------------------------------------------------------
def test_ray_processor_messages_with_image_parts(llava_dir):
    """Ray's ``messages`` with image parts (``image`` with bytes, ``image_url`` with a data: URL),
    as its vLLM engine stage takes them, with ``has_image=True``: each row as ``LLM.chat`` gives it."""
    import base64

    from dfllm import build_processor, vLLMEngineProcessorConfig

    a, b = random_image(31, (40, 40)), random_image(32, (64, 20))
    url = "data:image/png;base64," + base64.b64encode(png_bytes(b)).decode()
    frame = pd.DataFrame(
        {
            "q": ["Describe:", "What is it?", "Broken:"],
            "img": pd.Series([png_bytes(a), url, b"not an image"], dtype=object),
        }
    )

    def preprocess(row: dict) -> dict:
        part = (
            {"type": "image_url", "image_url": {"url": row["img"]}}
            if isinstance(row["img"], str)
            else {"type": "image", "image": row["img"]}
        )
        return {
            "q": row["q"],
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": row["q"]}]}],
            "sampling_params": {"max_tokens": 6, "temperature": 0},
        }

    config = vLLMEngineProcessorConfig(
        model_source=str(llava_dir),
        engine_kwargs={"max_model_len": 256},
        has_image=True,
        prepare_image_stage=True,
        should_continue_on_error=True,
    )
    out = build_processor(
        config,
        preprocess=preprocess,
        postprocess=lambda r: {"q": r["q"], "answer": r["generated_text"], "tokens": r["generated_tokens"]},
    )(frame)
    llm = engine_cache.get_engine(str(llava_dir), {"max_model_len": 256})
    for i, im in ((0, a), (1, b)):
        want = llm.chat(
            [
                {
                    "role": "user",
                    "content": [{"type": "image_pil", "image_pil": im}, {"type": "text", "text": frame.q[i]}],
                }
            ],
            GREEDY,
            use_tqdm=False,
        )[0].outputs[0]
        assert list(out["tokens"][i]) == list(want.token_ids) and out["answer"][i] == want.text
    assert "cannot decode image" in out["__inference_error__"][2]


@pytest.mark.slow
def test_dfllm_run_images_column(client, clip_dir, tmp_path):
    import subprocess
    import sys

    a = random_image(41)
    pq.write_table(
        pa.table({"id": [0, 1, 2], "img": pa.array([png_bytes(a), None, png_bytes(a)], pa.binary())}),
        tmp_path / "in.parquet",
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dfllm.jobs.cli",
            "run",
            str(tmp_path / "in.parquet"),
            str(tmp_path / "out"),
            "--task",
            "embed",
            "--images-column",
            "img",
            "--model",
            str(clip_dir),
            "--scheduler",
            client.scheduler.address,
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = pd.read_parquet(tmp_path / "out").sort_values("id").reset_index(drop=True)
    want = LLM(model=clip_dir, runner="pooling").embed({"multi_modal_data": {"image": a}}, use_tqdm=False)
    for i in (0, 2):
        assert list(result["embedding"][i]) == pytest.approx(want[0].outputs.embedding, abs=1e-5)
    assert "is null" in result["llm_error"][1]


@pytest.mark.slow
def test_response_cache_keys_rows_by_their_images(llava_dir, tmp_path):
    """Two rows with the same prompt and different images never share a response-cache entry
    (their placeholder tokens are the same; the images' content hashes are in the key)."""
    a, b = random_image(51), random_image(52)
    kw = dict(
        model=str(llava_dir),
        max_model_len=256,
        sampling_params=GREEDY,
        cache=str(tmp_path / "cache"),
        engine_columns=["generated_tokens", "from_cache"],
    )
    first = pd.DataFrame({"q": ["Describe:"], "img": [png_bytes(a)]}).llm.generate("<image>\n{q}", images="img", **kw)
    again = pd.DataFrame({"q": ["Describe:"] * 2, "img": [png_bytes(a), png_bytes(b)]}).llm.generate(
        "<image>\n{q}", images="img", **kw
    )
    assert not first["from_cache"][0] and again["from_cache"].tolist() == [True, False]
    assert list(again["generated_tokens"][0]) == list(first["generated_tokens"][0])
    assert list(again["generated_tokens"][1]) == hf_llava_greedy(llava_dir, "<image>\nDescribe:", [b])
