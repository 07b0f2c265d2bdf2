"""Response cache entries that are hostile: nested too deeply for the JSON parser, or forged
with a valid checksum (a failed output, token ids no vocabulary has). Each is a miss (logged,
counted, deleted), the row is computed again, and the job goes on: never a crash, never an
answer the engine would not give. Real parts: the tiny random Llama, entries a real job
wrote.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dfllm
from dfllm.tasks import response_cache as rc

pytestmark = pytest.mark.timeout(600)

SP = {"temperature": 0.0, "max_tokens": 3}
ENGINE = {"max_model_len": 64}
OUTPUTS = ["generated_text", "num_input_tokens", "num_generated_tokens", "finish_reason", "llm_error"]
DEEP = "[" * 200_000 + "]" * 200_000


def frame() -> pd.DataFrame:
    return pd.DataFrame({"q": [f"Question {i}: why is the sky blue?" for i in range(3)]})


def generate(model: Path, cache: Path) -> pd.DataFrame:
    return frame().llm.generate(
        "{q}", model=str(model), sampling_params=SP, cache=str(cache), engine_columns=["from_cache"], **ENGINE
    )


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.json") if not p.name.startswith("."))


def forge(path: Path, edit) -> None:
    """Rewrite an entry's payload with ``edit`` and a checksum that matches it."""
    doc = json.loads(path.read_text())
    payload = json.loads(doc["payload"])
    replaced = edit(payload)  # a new payload (text), or None: edited in place
    payload = payload if replaced is None else replaced
    text = payload if isinstance(payload, str) else json.dumps(payload, sort_keys=True, separators=(",", ":"))
    doc["payload"], doc["sha256"] = text, hashlib.sha256(text.encode()).hexdigest()
    path.write_text(json.dumps(doc))


def _set(section: str, **fields):
    return lambda payload: payload[section].update(fields)


CORRUPTIONS = {
    "deep nesting": lambda p: p.write_text(DEEP),
    "deep nesting in a checked payload": lambda p: forge(p, lambda _: DEEP),
    "deep nesting in a checked completion": lambda p: forge(
        p, lambda pl: pl.__setitem__("completion", json.loads("[" * 500 + "]" * 500))
    ),
    "finish_reason error": lambda p: forge(p, _set("completion", finish_reason="error", error="boom")),
    "token id past the vocabulary": lambda p: forge(p, _set("completion", token_ids=[10**30])),
    "negative token id": lambda p: forge(p, _set("completion", token_ids=[-1, 2])),
    "token id just past the vocabulary": lambda p: forge(p, _set("completion", token_ids=[10**6])),
    "logprob token past the vocabulary": lambda p: forge(
        p, lambda pl: pl.__setitem__("logprobs", [[[10**30, -0.5, 1, "x"]]])
    ),
}


@pytest.fixture(scope="module")
def written(tiny_llama, tmp_path_factory):
    """A cache a real job wrote, and that job's outputs."""
    cache = tmp_path_factory.mktemp("hostile-cache") / "cache"
    want = generate(tiny_llama, cache)
    assert len(entries(cache)) == 3 and not want["from_cache"].any()
    return cache, want


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(kind=st.sampled_from(sorted(CORRUPTIONS)), which=st.integers(0, 2))
@example(kind="deep nesting", which=0)
@example(kind="deep nesting in a checked payload", which=1)
@example(kind="finish_reason error", which=2)
@example(kind="token id past the vocabulary", which=0)
def test_a_hostile_entry_is_a_miss_and_the_job_goes_on(written, tiny_llama, kind, which):
    cache, want = written
    files = entries(cache)
    assert len(files) == 3
    CORRUPTIONS[kind](files[which])
    before = rc.counts()["corrupt"]
    got = generate(tiny_llama, cache)  # never raises: the entry is a miss
    pd.testing.assert_frame_equal(got[OUTPUTS], want[OUTPUTS])
    assert got["from_cache"].sum() == 2 and rc.counts()["corrupt"] == before + 1
    again = generate(tiny_llama, cache)  # the row computed again was stored again, as it should be
    assert again["from_cache"].all()
    pd.testing.assert_frame_equal(again[OUTPUTS], want[OUTPUTS])


def test_decode_entry_refuses_deep_nesting_as_a_corrupt_entry():
    """The unit under the job above: a corrupt entry is a ValueError (the lookup's miss)."""
    with pytest.raises(ValueError, match="not JSON"):
        rc.decode_entry(DEEP.encode(), "key")
    text = DEEP
    doc = {"format": rc.FORMAT, "key": "key", "sha256": hashlib.sha256(text.encode()).hexdigest(), "payload": text}
    with pytest.raises(ValueError, match="not JSON"):
        rc.decode_entry(json.dumps(doc).encode(), "key")


@pytest.fixture(autouse=True, scope="module")
def _release():
    yield
    dfllm.release_engines()
