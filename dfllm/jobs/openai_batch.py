"""The lines of OpenAI batch files, as typed objects: one request in, one answer out.

An input line (OpenAI's batch input, which ``vllm run-batch`` reads too)::

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}}

is a :class:`BatchRequestInput` (:func:`parse_line`), its ``body`` checked into the
endpoint's request (:mod:`dfllm.jobs.openai_requests`). Its answer is a
:class:`BatchRequestOutput` (OpenAI's ``BatchRequestOutput`` schema)::

    {"id": "batch_req_<hex>", "custom_id": "request-1",
     "response": {"status_code": 200, "request_id": "req_<hex>", "body": {...chat.completion...}},
     "error": null}

A line that cannot be answered keeps its place and says why, in both the forms readers of
OpenAI's and of vLLM's files look for: ``response.status_code`` is the HTTP status (400 a
bad request, 404 an unknown ``url``, 405 a method other than POST, 500 a failure in the
engine), ``response.body`` OpenAI's error body ``{"error": {"message", "type", "param",
"code"}}``, and ``error`` is ``{"code", "message", "param", "line"}`` (the fields of
OpenAI's ``BatchError``; ``line`` is the 1-based line number in the input file). Messages
start with ``line N:`` and name the field at fault (``body.max_tokens``).

The ids are derived from the line (its place in the file, its text and the job's settings),
so a resumed job gives every line the id it had.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, fields
from typing import Any

from dfllm.errors import clipped, printable, shown
from dfllm.jobs.openai_requests import LineError, parse_body

#: The endpoints dfllm answers, by the ``url`` of a line; vLLM's spellings of score and
#: rerank (without ``/v1``, and ``/v2/rerank``) are accepted too.
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/score": "score",
    "/score": "score",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
}
SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")


@dataclass
class BatchRequestInput:
    """One line of an input file: ``custom_id``, ``method``, ``url`` and ``body`` as given,
    ``endpoint`` (``chat``, ``completions``, ``embeddings``, ``score`` or ``rerank``), and
    ``request``, the body checked into that endpoint's request
    (:class:`~dfllm.jobs.openai_requests.ChatCompletionRequest`...). ``key`` (hex) names the
    line in the ids of its answer."""

    custom_id: str
    method: str
    url: str
    body: dict
    endpoint: str
    request: Any
    key: str = ""

    @property
    def id(self) -> str:
        """The answer line's ``id``."""
        return f"batch_req_{self.key}"

    @property
    def request_id(self) -> str:
        """The answer's ``response.request_id``."""
        return f"req_{self.key}"


def parse_line(text: str, key: str = "") -> BatchRequestInput:
    """One input line (JSON text) as a :class:`BatchRequestInput`, its body checked for its
    endpoint; :class:`LineError` naming the field at fault otherwise (never another
    exception: whatever a line holds, it is that line's error)."""
    try:
        return _parse_line(text, key)
    except LineError:
        raise
    except Exception as exc:  # noqa: BLE001  (a line the checks did not foresee is still that line's error)
        raise LineError(f"the line cannot be read: {type(exc).__name__}: {exc}") from None


def _parse_line(text: str, key: str) -> BatchRequestInput:
    line = load_line(text)
    if not isinstance(line, dict):
        raise LineError(
            f"the line must be a JSON object with custom_id, method, url and body, got {type(line).__name__}",
            code="invalid_json",
        )
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(f"custom_id must be a non-empty string, got {shown(custom_id)}", param="custom_id")
    method = line.get("method", "POST")
    if method != "POST":
        raise LineError(
            f'method must be "POST", got {shown(method)}', status=405, code="method_not_allowed", param="method"
        )
    url = line.get("url")
    if not isinstance(url, str):
        raise LineError(
            f"url must be one of {', '.join(SUPPORTED_URLS)}, got {shown(url)}",
            status=404,
            code="unknown_url",
            param="url",
        )
    endpoint = ENDPOINTS.get(url.rstrip("/"))
    if endpoint is None:
        raise LineError(
            f"URL {clipped(url)} was used. Supported endpoints: {', '.join(SUPPORTED_URLS)}",
            status=404,
            code="unknown_url",
            param="url",
        )
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineError(
            f"body must be a JSON object (the {url} request), got {'nothing' if body is None else type(body).__name__}",
            param="body",
        )
    return BatchRequestInput(custom_id, method, url, body, endpoint, parse_body(endpoint, body, url), key)


def custom_id_of(text: str) -> str | None:
    """The ``custom_id`` of a line that could not be parsed as a request, when it has one
    (so that its error line still names it), its lone surrogates escaped (:func:`printable`);
    read past a byte-order mark that starts the line (one inside the file, which the line's
    error is about)."""
    try:
        line = json.loads(text.removeprefix("\ufeff"), parse_int=_read_int)
    except (ValueError, RecursionError):
        return None
    value = line.get("custom_id") if isinstance(line, dict) else None
    return printable(value) if isinstance(value, str) else None


# ---- reading a line ---------------------------------------------------------------------------------
class _TooLong:
    """An integer of more digits than Python converts (``sys.get_int_max_str_digits()``)."""

    def __init__(self, digits: str):
        self.digits = digits


def _read_int(digits: str) -> int | _TooLong:
    limit = sys.get_int_max_str_digits()
    return _TooLong(digits) if limit and len(digits.lstrip("-")) > limit else int(digits)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of a surrogate (paired or not)


def load_line(text: str) -> Any:
    """A line's JSON value; :class:`LineError` for text that is not JSON, for an integer of
    more digits than Python reads (naming its field), and for a string holding a lone
    surrogate (``"\\ud83d"``: valid JSON, but not Unicode text; naming its field)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise LineError(f"the line is not valid JSON ({exc})", code="invalid_json") from None
    except ValueError:  # Python's limit on the digits of an integer
        value = json.loads(text, parse_int=_read_int)
        where, found = _find(value, lambda v: isinstance(v, _TooLong))
        digits = len(found.digits.lstrip("-")) if isinstance(found, _TooLong) else 0
        limit = f"dfllm reads integers of at most {sys.get_int_max_str_digits():,} digits"
        if where is None:  # the line is that integer: not the JSON object a line must be
            raise LineError(
                f"the line must be a JSON object with custom_id, method, url and body, got an integer of "
                f"{digits:,} digits ({limit})",
                code="invalid_json",
            ) from None
        raise LineError(f"{clipped(where)}: an integer of {digits:,} digits; {limit}", param=where) from None
    if _SURROGATE_ESCAPE.search(text):
        where, found = _find(value, lambda v: isinstance(v, str) and printable(v) is not v)
        if where is not None:
            assert isinstance(found, str)
            at = next(i for i, c in enumerate(found) if 0xD800 <= ord(c) <= 0xDFFF)
            raise LineError(
                f"{clipped(where)} is not valid Unicode text: it holds a lone surrogate ({printable(found[at])} at "
                f"character {at}), which has no UTF-8 form",
                param=where,
            )
    return value


def _find(value: Any, bad) -> tuple[str | None, Any]:
    """The field (``body.messages[0].content``) of the first part of a line's JSON value for
    which ``bad`` holds (a dict key counts as its field), and that part; ``(None, None)``
    if none. Iterative: a deeply nested line does not exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, v = stack.pop()
        if bad(v):
            return where or None, v
        if isinstance(v, dict):
            for k in reversed(list(v)):
                field = f"{where}.{printable(k)}" if where else printable(k)
                if bad(k):
                    return field, k
                stack.append((field, v[k]))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", item) for i, item in reversed(list(enumerate(v))))
    return None, None


# ---- answers ---------------------------------------------------------------------------------------
@dataclass
class BatchError:
    """The ``error`` of an answer line: OpenAI's ``BatchError`` fields."""

    code: str | None
    message: str
    param: str | None = None
    line: int | None = None

    def body(self, status: int) -> dict:
        """OpenAI's error response body for this error (``response.body`` of the line)."""
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class BatchResponse:
    """The ``response`` of an answer line: ``status_code``, ``request_id`` and ``body`` (the
    endpoint's response, or OpenAI's error body)."""

    status_code: int
    request_id: str
    body: dict | None


@dataclass
class BatchRequestOutput:
    """One line of an output (or error) file, OpenAI's ``BatchRequestOutput``."""

    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchError | None = None

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "custom_id": self.custom_id,
            "response": _fields(self.response),
            "error": _fields(self.error),
        }

    def to_json(self) -> str:
        """The line as strict JSON text (:func:`strict_json`)."""
        return strict_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> BatchRequestOutput:
        """An answer line read back (from an output file of dfllm, vLLM or OpenAI)."""
        r, e = data.get("response"), data.get("error")
        response = None if r is None else BatchResponse(r.get("status_code"), r.get("request_id"), r.get("body"))
        if isinstance(e, str):  # vLLM's older files: the message alone
            e = {"code": None, "message": e}
        error = None if e is None else BatchError(e.get("code"), e.get("message") or "", e.get("param"), e.get("line"))
        return cls(data.get("id") or "", data.get("custom_id"), response, error)

    @property
    def ok(self) -> bool:
        """Whether the request was answered (status 200, no error)."""
        return self.error is None and self.response is not None and self.response.status_code == 200


def _fields(part: BatchResponse | BatchError | None) -> dict | None:
    """An answer line's ``response`` or ``error`` as JSON: its fields, by OpenAI's names (values not copied)."""
    return None if part is None else {f.name: getattr(part, f.name) for f in fields(part)}


def answer_line(
    key: str, custom_id: str | None, status: int, body_json: str | None, error: BatchError | None = None
) -> str:
    """An answer line as JSON text, its body given as JSON text already (answers are
    streamed from the job's parts without parsing their bodies again)."""
    if error is not None:
        body_json = strict_json(error.body(status))
        err = strict_json(_fields(error))
    else:
        err = "null"
    return (
        f'{{"id": "batch_req_{key}", "custom_id": {strict_json(custom_id)}, '
        f'"response": {{"status_code": {int(status)}, "request_id": "req_{key}", '
        f'"body": {body_json if body_json is not None else "null"}}}, "error": {err}}}'
    )


def strict_json(value: Any) -> str:
    """``value`` as JSON text every JSON reader reads (text as it is, not ``\\u`` escaped): a
    non-finite float (NaN, inf), which ``json.dumps`` would write as the bare ``NaN`` or
    ``Infinity`` that strict readers refuse, is null, as ``vllm run-batch`` writes it
    (pydantic's default)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a non-finite float somewhere in it
        return json.dumps(_finite(value), ensure_ascii=False, allow_nan=False)


def _finite(value: Any) -> Any:
    """``value`` with each non-finite float, at any depth, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
