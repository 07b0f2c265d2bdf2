"""``dfllm run-batch`` input and output lines: OpenAI batch-file requests, JSON Lines files, and
the check that an output line parses as the ``openai`` package's types."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dfllm.jobs.openai_batch import BatchRequestOutput

pytest.importorskip("openai.types")
from openai.types import BatchError, Completion, CreateEmbeddingResponse  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

ENGINE = {"max_model_len": 128, "kv_cache_memory_bytes": 2**22}


def line(custom_id: str, url: str = "/v1/chat/completions", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(custom_id: str, text: str, **params) -> dict:
    params.setdefault("max_completion_tokens", 3)
    params.setdefault("temperature", 0)
    return line(custom_id, model="gpt-4o-mini", messages=[{"role": "user", "content": text}], **params)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(t) for t in path.read_text().splitlines()]


def check_line(out: dict) -> None:
    """One output line has OpenAI's BatchRequestOutput fields, and its body parses as the
    ``openai`` package's type for its endpoint (or its error as a BatchError)."""
    assert set(out) == {"id", "custom_id", "response", "error"}
    assert out["id"].startswith("batch_req_") and out["response"]["request_id"].startswith("req_")
    response = out["response"]
    assert set(response) == {"status_code", "request_id", "body"}
    parsed = BatchRequestOutput.from_dict(out)
    if out["error"] is not None:
        assert response["status_code"] != 200 and not parsed.ok
        BatchError.model_validate(out["error"])
        assert out["error"]["message"].startswith(f"line {out['error']['line']}: ")
        assert response["body"]["error"]["message"] == out["error"]["message"]
        return
    assert response["status_code"] == 200 and parsed.ok
    body = response["body"]
    kind = body.get("object")
    if kind == "chat.completion":
        ChatCompletion.model_validate(body)
    elif kind == "text_completion":
        Completion.model_validate(body)
    elif kind == "list" and body["data"] and body["data"][0].get("object") == "embedding":
        if isinstance(body["data"][0]["embedding"], list):
            CreateEmbeddingResponse.model_validate(body)
