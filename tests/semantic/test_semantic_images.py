"""Image columns in the semantic operators: ``sim_join(..., left_images=/right_images=)`` and
``dedup(..., images=True)`` through an image-text model (a tiny random CLIP saved as a real
Hugging Face directory). Text-to-image and image-to-image neighbours equal numpy's cosine
k-nearest over the embeddings ``LLM(clip, runner="pooling").embed`` gives; image clusters
equal the brute-force connected components; an unreadable image is its row's error while
every other row is answered; a text-only model is refused; Dask on a LocalCluster of worker
processes (images read from parquet, decoded on the workers only) equals pandas."""

from __future__ import annotations

import re
from pathlib import Path

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import dfllm.accessors.pandas_ext  # noqa: F401  (registers .llm)
import dfllm.accessors.polars_ext  # noqa: F401
from dfllm import LLM
from dfllm.semantic.join import Embedder
from dfllm.tasks.task import make_task

from helpers import local_client
from image_data import build_tiny_clip, png_bytes

QUERIES = ["a red shoe", "two dogs playing in the snow", "x"]
BROKEN = b"\x89PNG not really an image"


def two_tone(seed: int) -> Image.Image:
    """A 32x32 image of two coloured halves: distinct seeds embed far enough apart (cosine
    0.4 to 0.98 on the tiny CLIP) for the neighbours and clusters to mean something."""
    rng = np.random.default_rng(seed)
    a = np.zeros((32, 32, 3), np.uint8) + rng.integers(0, 256, 3).astype(np.uint8)
    a[:, :16] = rng.integers(0, 256, 3)
    return Image.fromarray(a)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    return build_tiny_clip(tmp_path_factory.mktemp("clip"), "clip")


@pytest.fixture(scope="module")
def reference(clip_dir) -> LLM:
    return LLM(model=clip_dir, runner="pooling")


def unit_vectors(llm: LLM, prompts: list, images: bool = True) -> np.ndarray:
    """The normalised embeddings of images (as a column's cells: bytes, paths, PIL), or texts."""
    prompts = [{"multi_modal_data": {"image": p}} for p in prompts] if images else prompts
    v = np.array([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)], dtype=np.float64)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def knn(lv: np.ndarray, rv: np.ndarray, lids: list, rids: list, k: int) -> list[tuple]:
    """``(left id, right id, cosine)`` of each left row's ``k`` nearest right rows, nearest first
    (ties by right position), by brute force."""
    sims = lv @ rv.T
    out = []
    for i, row in enumerate(sims):
        for j in np.lexsort((np.arange(len(row)), -row))[:k]:
            out.append((lids[i], rids[j], float(row[j])))
    return out


def matches(out: pd.DataFrame, left: str, right: str) -> list[tuple]:
    ok = out[out["llm_error"].isna()]
    return [(int(a), int(b), float(s)) for a, b, s in zip(ok[left], ok[right], ok["similarity"])]


def assert_same_pairs(got: list[tuple], want: list[tuple]) -> None:
    assert [(a, b) for a, b, _ in got] == [(a, b) for a, b, _ in want]
    assert [s for *_, s in got] == pytest.approx([s for *_, s in want], abs=1e-5)


def photo_cells(tmp_path: Path) -> tuple[list, list[int]]:
    """Seven photo cells (PNG bytes, one unreadable, one a file path) and the readable rows."""
    file = tmp_path / "p6.png"
    two_tone(6).save(file)
    cells = [png_bytes(two_tone(i)) for i in range(5)] + [BROKEN, str(file)]
    return cells, [0, 1, 2, 3, 4, 6]


# ---- sim_join ---------------------------------------------------------------------------------------------
def test_sim_join_text_to_image_and_image_to_image(clip_dir, reference, tmp_path):
    cells, ok = photo_cells(tmp_path)
    photos = pd.DataFrame({"pid": range(len(cells)), "photo": pd.Series(cells, dtype=object)})
    queries = pd.DataFrame({"qid": range(len(QUERIES)), "query": QUERIES})
    image_vecs = unit_vectors(reference, [cells[i] for i in ok])

    # text -> image: each query's 3 nearest photos, as numpy finds them over LLM.embed's vectors
    out, cost = queries.llm.sim_join(
        photos, "query", "photo", k=3, right_images=True, embed_model=str(clip_dir), return_stats=True
    )
    want = knn(unit_vectors(reference, QUERIES, images=False), image_vecs, list(range(len(QUERIES))), ok, 3)
    assert_same_pairs(matches(out, "qid", "pid"), want)
    # the unreadable photo comes once, alone, with its error; every other row is answered
    bad = out[out["llm_error"].notna()]
    assert len(bad) == 1 and int(bad["pid"].iloc[0]) == 5 and pd.isna(bad["qid"].iloc[0])
    assert "right index 5" in bad["llm_error"].iloc[0] and "images column 'photo'" in bad["llm_error"].iloc[0]
    assert "cannot decode image" in bad["llm_error"].iloc[0]
    assert cost.engine_calls == 2 and cost.requests == len(QUERIES) + len(cells)

    # image -> image: PIL images and an unreadable cell on the left, both sides embedded as images
    left_cells = [two_tone(4), two_tone(9), BROKEN, png_bytes(two_tone(0))]
    left = pd.DataFrame({"pid": [10, 11, 12, 13], "photo": pd.Series(left_cells, dtype=object)})
    pairs = left.llm.sim_join(
        photos, "photo", "photo", k=2, left_images=True, right_images=True, embed_model=str(clip_dir)
    )
    assert {"photo", "photo_right", "pid_right", "similarity", "llm_error"} <= set(pairs.columns)
    want = knn(unit_vectors(reference, [left_cells[i] for i in (0, 1, 3)]), image_vecs, [10, 11, 13], ok, 2)
    assert_same_pairs(matches(pairs, "pid", "pid_right"), want)
    assert want[0][1] == 4 and want[0][2] == pytest.approx(1.0, abs=1e-5)  # a PIL image finds its own bytes
    errors = pairs[pairs["llm_error"].notna()]
    assert sorted(errors["llm_error"].str.slice(0, 13)) == ["left index 2:", "right index 5"]

    # Polars (a Binary column), as pandas
    pout = pl.from_pandas(queries).llm.sim_join(
        pl.DataFrame(
            {
                "pid": list(range(len(cells))),
                "photo": pl.Series(
                    [c if isinstance(c, bytes) else Path(c).read_bytes() for c in cells], dtype=pl.Binary
                ),
            }
        ),
        "query",
        "photo",
        k=3,
        right_images=True,
        embed_model=str(clip_dir),
    )
    assert isinstance(pout, pl.DataFrame)
    assert_same_pairs(matches(pout.to_pandas(), "qid", "pid"), matches(out, "qid", "pid"))


def test_text_only_model_refused_for_images(clip_dir):
    queries = pd.DataFrame({"query": QUERIES})
    photos = pd.DataFrame({"photo": [png_bytes(two_tone(0))]})
    with pytest.raises(
        ValueError,
        match=r"sim_join: right_images=True embeds images: 'all-minilm-l6-v2' is a "
        r"text-only model; .*image-text embed_model \(CLIP, SigLIP\)",
    ):
        queries.llm.sim_join(photos, "query", "photo", k=1, right_images=True)  # the default: MiniLM
    with pytest.raises(ValueError, match="left_images=True embeds images: .* text-only"):
        photos.llm.sim_join(queries, "photo", "query", k=1, left_images=True)
    with pytest.raises(ValueError, match="dedup: images=True embeds images: .* text-only"):
        photos.llm.dedup("photo", images=True)
    with pytest.raises(ValueError, match="right_images must be True or False"):
        queries.llm.sim_join(photos, "query", "photo", k=1, right_images="photo", embed_model=str(clip_dir))
    with pytest.raises(ValueError, match="confirm"):
        photos.llm.dedup("photo", images=True, confirm=True, embed_model=str(clip_dir))
    # a model only the workers have is checked there: every row gets the same refusal as its error
    task = make_task(
        "embed",
        (),
        ["photo"],
        images="photo",
        output_column="v",
        model="all-minilm-l6-v2",
        model_check=lambda task: None,
    )
    vecs, errors = Embedder(task)(pd.DataFrame({"photo": [png_bytes(two_tone(0)), BROKEN]}))
    assert vecs.shape[0] == 2 and len(errors) == 2
    assert all("'all-minilm-l6-v2' is a text-only model" in e for e in errors)


# ---- dedup ------------------------------------------------------------------------------------------------
DEDUP_SEEDS = [0, 1, 0, 2, 1, 3, None, 4, 0, 5]  # None: an unreadable cell; repeats are the same bytes


def components(vecs: np.ndarray, rows: list[int], threshold: float, n: int) -> list:
    """Each row's cluster id (its component's first row; None for rows not in ``rows``) from
    the similarity matrix, by a breadth-first search."""
    sims = vecs @ vecs.T
    ids: list = [None] * n
    for a in range(len(rows)):
        if ids[rows[a]] is not None:
            continue
        stack, ids[rows[a]] = [a], rows[a]
        while stack:
            x = stack.pop()
            for y in np.flatnonzero(sims[x] >= threshold):
                if ids[rows[y]] is None:
                    ids[rows[y]] = rows[a]
                    stack.append(y)
    return ids


def dedup_cells() -> list:
    return [BROKEN if s is None else png_bytes(two_tone(s)) for s in DEDUP_SEEDS]


def test_dedup_images_equals_brute_force_components(clip_dir, reference):
    cells = dedup_cells()
    rows = [i for i, s in enumerate(DEDUP_SEEDS) if s is not None]
    vecs = unit_vectors(reference, [cells[i] for i in rows])
    sims = vecs @ vecs.T
    same = np.array([[DEDUP_SEEDS[a] == DEDUP_SEEDS[b] for b in rows] for a in rows])
    assert sims[same].min() > 1 - 1e-5 and sims[~same].max() < 0.99  # repeats are one point, the rest apart
    df = pd.DataFrame({"id": range(len(cells)), "photo": pd.Series(cells, dtype=object)})
    strict = (1 + sims[~same].max()) / 2  # only exact repeats link
    loose = float(np.quantile(sims[~same], 0.6))  # distinct images chain into larger clusters too
    for threshold in (strict, loose):
        out, cost = df.llm.dedup(
            "photo", images=True, threshold=threshold, embed_model=str(clip_dir), return_stats=True
        )
        want = components(vecs, rows, threshold, len(cells))
        got = [None if pd.isna(c) else int(c) for c in out["cluster_id"]]
        assert got == want
        assert list(out["id"]) == list(range(len(cells)))
        assert cost.engine_calls == 1 and cost.requests == len(cells)
        assert "dedup: images column 'photo'" in out["llm_error"][6] and "cannot decode" in out["llm_error"][6]
        assert out["llm_error"].drop(index=6).isna().all() and pd.isna(out["is_representative"][6])
    # strict: exactly the repeated images (the first of each seed); loose: fewer, larger clusters
    first = {s: DEDUP_SEEDS.index(s) for s in DEDUP_SEEDS if s is not None}
    assert components(vecs, rows, strict, len(cells)) == [None if s is None else first[s] for s in DEDUP_SEEDS]
    assert len({c for c in want if c is not None}) < len(first)  # want: the loose threshold's components


# ---- Dask ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    with local_client(workers=2, threads=1) as c:
        yield c


def rows_of(df: pd.DataFrame, columns: list[str]) -> list[tuple]:
    """A frame's rows as sortable tuples (nulls as -1 / "", floats rounded)."""

    def cell(v):
        if v is None or (np.ndim(v) == 0 and pd.isna(v)):
            return -1
        if isinstance(v, str):
            return re.sub(r" at 0x[0-9a-f]+", "", v)  # the message names a buffer's address
        return round(float(v), 5) if isinstance(v, float) else v

    return sorted(tuple(cell(v) for v in row) for row in df[columns].astype(object).itertuples(index=False))


@pytest.mark.slow
def test_dask_image_sim_join_and_dedup_equal_pandas(client, clip_dir, tmp_path, monkeypatch):
    cells = dedup_cells()
    path = tmp_path / "photos.parquet"
    pq.write_table(
        pa.table({"pid": pa.array(range(len(cells)), pa.int64()), "photo": pa.array(cells, pa.large_binary())}),
        path,
        row_group_size=5,
    )
    queries = pd.DataFrame({"qid": range(4), "query": [*QUERIES, "a blue square"]})

    import dfllm.multimodal

    def no_decoding_here(value):
        raise AssertionError("an image was decoded on the client")

    monkeypatch.setattr(dfllm.multimodal, "load_image", no_decoding_here)  # this process only, not the workers
    photos = dd.read_parquet(path).repartition(npartitions=2)
    lazy_join = dd.from_pandas(queries, npartitions=2).llm.sim_join(
        photos, "query", "photo", k=2, right_images=True, embed_model=str(clip_dir)
    )
    lazy_dedup = photos.llm.dedup("photo", images=True, threshold=0.95, embed_model=str(clip_dir))
    assert list(lazy_dedup._meta.columns) == ["pid", "photo", "cluster_id", "is_representative", "llm_error"]
    joined, clusters = dask.compute(lazy_join, lazy_dedup)  # both graphs at once, on the workers
    monkeypatch.undo()  # the pandas references below decode here

    local = pd.read_parquet(path)
    want_join = queries.llm.sim_join(local, "query", "photo", k=2, right_images=True, embed_model=str(clip_dir))
    cols = ["qid", "pid", "similarity", "llm_error"]
    assert rows_of(joined, cols) == rows_of(want_join, cols)
    assert len(joined) == 4 * 2 + 1 and joined["llm_error"].notna().sum() == 1  # the broken photo, once
    want_dedup = local.llm.dedup("photo", images=True, threshold=0.95, embed_model=str(clip_dir))
    cols = ["pid", "cluster_id", "is_representative", "llm_error"]
    assert rows_of(clusters, cols) == rows_of(want_dedup, cols)
    assert clusters["cluster_id"].notna().sum() == len(cells) - 1
