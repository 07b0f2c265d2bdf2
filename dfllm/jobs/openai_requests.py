"""The request bodies of OpenAI's endpoints (and vLLM's score and rerank), as typed objects.

Each ``from_body`` checks one line's ``body`` and names the field at fault
(:class:`LineError`, ``param="body.max_tokens"``); a field the
endpoint does not have is refused, so that a typo is not ignored silently. OpenAI's fields
that change nothing here (``user``, ``store``, ``metadata``, ``service_tier``...) are
accepted; ``stream: true`` is refused (a batch line has one answer), and so are tools,
audio and images, which dfllm does not run.

The generative requests map onto :class:`dfllm.LLM`'s own path: for a
:class:`ChatCompletionRequest` ``r``, ``llm.chat([r.messages], r.sampling_params(),
**r.chat_kwargs())`` is what a batch line runs (``dfllm run-batch`` goes through the same
input processor and sampling params), and
:func:`dfllm.jobs.openai_responses.chat_completion` turns its output into the response body.

- ``chat``: ``messages``, ``max_completion_tokens``/``max_tokens`` (default: up to the
  context length), ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``presence_penalty``,
  ``frequency_penalty``, ``logit_bias``, ``logprobs``/``top_logprobs``, ``response_format``
  (``text``, ``json_object``, ``json_schema``); vLLM's ``top_k``, ``min_p``,
  ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
  ``structured_outputs`` and ``guided_*``, ``chat_template``, ``chat_template_kwargs``,
  ``add_generation_prompt``, ``continue_final_message``...
- ``completions``: ``prompt`` (text, token ids, or a list of either), ``max_tokens``
  (default 16), ``echo``, ``logprobs`` (an int), and the sampling fields above.
- beam search (both, vLLM's server fields): ``use_beam_search: true`` makes the line a beam
  search (:func:`_beam`) of width ``n`` (``best_of`` ignored), with ``length_penalty``,
  ``max_tokens``, ``temperature`` (default 1, vLLM's), ``ignore_eos``,
  ``include_stop_str_in_output``, ``skip_special_tokens``, ``truncate_prompt_tokens``, an
  output constraint (each beam's continuation constrained) and ``logprobs``; the fields beam
  search cannot honour (:data:`BEAM_REFUSED`) are refused by name when set to anything but
  their neutral value.
- ``embeddings``: ``input`` (text, token ids, or a list of either), ``encoding_format``
  (``float`` or ``base64``), ``dimensions`` (a Matryoshka model's, checked by the engine).
- ``score`` (vLLM): ``text_1`` and ``text_2``, each a text or a list (1 to 1, 1 to N, N to N).
- ``rerank`` (vLLM, Jina, Cohere): ``query``, ``documents`` (texts or ``{"text": ...}``),
  ``top_n``, ``return_documents``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dfllm.beam_search import BeamSearchParams
from dfllm.errors import InvalidRequestError, clipped, shown
from dfllm.inputs import VALID_ROLES
from dfllm.pooling_params import PoolingParams
from dfllm.sampling_params import SamplingParams
from dfllm.structured_outputs import StructuredOutputsParams

#: OpenAI fields accepted everywhere that change nothing in a batch run here.
IGNORED = frozenset(
    {
        "user",
        "store",
        "metadata",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "stream_options",
        "request_id",
        "priority",
        "add_special_tokens",
        "spaces_between_special_tokens",
        "guided_decoding_backend",
        "parallel_tool_calls",
        "reasoning_effort",
        "verbosity",
        "model",
    }
)
#: vLLM's sampling fields, passed to :class:`~dfllm.SamplingParams` as they are.
VLLM_SAMPLING = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "allowed_token_ids",
    "truncate_prompt_tokens",
)
#: The body fields that constrain the output (one at most per request).
CONSTRAINTS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
SAMPLING = (
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    *CONSTRAINTS,
    "stream",
    "use_beam_search",
    "length_penalty",
) + VLLM_SAMPLING
#: The sampling fields a beam search (``use_beam_search: true``) cannot honour, with the values
#: that leave sampling as it is (accepted): any other value is refused by name. vLLM's server
#: ignores them silently; dfllm says so.
BEAM_REFUSED: dict[str, tuple] = {
    "top_p": (1, 1.0),
    "top_k": (0, -1),
    "min_p": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "stop": ("", []),
    "stop_token_ids": ([],),
    "seed": (),
    "min_tokens": (0,),
    "bad_words": ([],),
    "allowed_token_ids": (),
}
#: vLLM's server's default beam search temperature (its sampling default).
BEAM_TEMPERATURE = 1.0
#: OpenAI fields for what dfllm does not run: refused unless empty, null or false.
UNSUPPORTED = {
    "tools": "tool calling",
    "functions": "function calling",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "suffix": "suffix (insertion)",
}
STREAM_REFUSED = "Request must not be sent in stream mode"
_STREAM_ERROR = STREAM_REFUSED + " (body.stream: a batch line gets one answer; set it to false)"
#: The arguments transformers' ``apply_chat_template`` and its template rendering take
#: themselves: not template variables a line may set through ``chat_template_kwargs``.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


# ---- checks -------------------------------------------------------------------------------------------
class LineError(ValueError):
    """Why a batch line gets an error answer instead of a response: the HTTP ``status``,
    a short ``code`` (``invalid_json``, ``invalid_request``, ``unknown_url``,
    ``engine_error``...), the message (without the line number: the output adds it) and
    ``param``, the field at fault (``body.messages[0].role``) or None."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    @property
    def message(self) -> str:
        return str(self)

    def __reduce__(self):  # keeps status, code and param across pickling (Dask workers)
        return _rebuild, (str(self), self.status, self.code, self.param)


def _rebuild(message: str, status: int, code: str, param: str | None) -> LineError:
    return LineError(message, status=status, code=code, param=param)


def _check_fields(body: dict, known: tuple[str, ...], url: str) -> None:
    for name in body:
        if name in UNSUPPORTED:
            if body[name] in (None, False, "", [], {}):
                continue
            raise LineError(f"body.{name}: {UNSUPPORTED[name]} is not supported by dfllm", param=f"body.{name}")
        if name not in known and name not in IGNORED:
            raise LineError(
                f"body.{clipped(name)} is not a field of {url} requests (see docs/batch.md for the fields dfllm reads)",
                param=f"body.{name}",
            )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _typed(body: dict, name: str, ok: Callable[[Any], bool], what: str) -> Any:
    """``body[name]``, None when absent or null; ``LineError`` saying it must be ``what`` unless ``ok(value)``."""
    v = body.get(name)
    if v is not None and not ok(v):
        raise LineError(f"body.{name} must be {what}, got {clipped(json.dumps(v))}", param=f"body.{name}")
    return v


def _int(body: dict, name: str, default: int | None = None, low: int | None = None) -> int | None:
    v = _typed(body, name, _is_int, "an integer")
    if v is None:
        return default
    if low is not None and v < low:
        raise LineError(f"body.{name} must be at least {low}, got {clipped(str(v))}", param=f"body.{name}")
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = _typed(body, name, lambda v: isinstance(v, bool), "true or false")
    return default if v is None else v


def _str(body: dict, name: str, required: bool = False) -> str | None:
    v = _typed(body, name, lambda v: isinstance(v, str), "a string")
    if v is None and required:
        raise LineError(f"body.{name} must be a string, got nothing", param=f"body.{name}")
    return v


def _dict(body: dict, name: str) -> dict | None:
    return _typed(body, name, lambda v: isinstance(v, dict), "a JSON object")


def _texts_or_ids(value: Any, name: str) -> list:
    """A prompt field (``prompt``, ``input``): text, token ids, or a non-empty list of either,
    as a list of prompts (text, or ``{"prompt_token_ids": [...]}``)."""
    where = f"body.{name}"
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(_is_int(t) for t in value):
            return [{"prompt_token_ids": list(value)}]
        out: list = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, list) and item and all(_is_int(t) for t in item):
                out.append({"prompt_token_ids": list(item)})
            else:
                raise LineError(
                    f"{where}[{i}] must be a string or a non-empty list of token ids, got {json.dumps(item)[:80]}",
                    param=f"{where}[{i}]",
                )
        return out
    raise LineError(
        f"{where} must be a string, a list of token ids, or a non-empty list of either, got "
        f"{'nothing' if value is None else json.dumps(value)[:80]}",
        param=where,
    )


def _check_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise LineError(
            f"body.messages must be a non-empty list of messages, got "
            f"{'nothing' if value is None else json.dumps(value)[:80]}",
            param="body.messages",
        )
    messages = []
    for i, msg in enumerate(value):
        where = f"body.messages[{i}]"
        if not isinstance(msg, dict):
            raise LineError(f"{where} must be a JSON object with role and content", param=where)
        if msg.get("role") not in VALID_ROLES:
            raise LineError(
                f"{where}.role must be one of {', '.join(VALID_ROLES)}, got {shown(msg.get('role'))}",
                param=f"{where}.role",
            )
        if msg.get("tool_calls") or msg.get("function_call"):
            raise LineError(f"{where}: tool calls are not supported by dfllm", param=f"{where}.tool_calls")
        content = msg.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise LineError(
                        f"{where}.content[{j}]: only text parts are supported, got "
                        f"{shown(kind or json.dumps(part)[:60])}",
                        param=f"{where}.content[{j}]",
                    )
        elif not isinstance(content, str):
            raise LineError(
                f"{where}.content must be a string or a list of text parts, got "
                f"{'nothing' if content is None else json.dumps(content)[:60]}",
                param=f"{where}.content",
            )
        messages.append({k: v for k, v in msg.items() if k in ("role", "content", "name")})
    return messages


def _constraints(body: dict) -> list[str]:
    """The body fields that give an output constraint (``response_format`` of type text gives none)."""
    given = [k for k in CONSTRAINTS if body.get(k) is not None]
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "text":
        given.remove("response_format")
    return given


def constraint_field(body: dict) -> str | None:
    """The body field that holds the line's output constraint, if any."""
    given = _constraints(body)
    return given[0] if given else None


def _structured(body: dict) -> StructuredOutputsParams | None:
    """The output constraint of ``response_format``, ``structured_outputs`` or vLLM's
    ``guided_*`` fields (at most one of them), checked: a grammar that does not compile is
    refused here, naming the field that held it (the engine checks it again)."""
    given = _constraints(body)
    if len(given) > 1:
        raise LineError(
            f"give one output constraint, not {' and '.join('body.' + g for g in given)}", param=f"body.{given[1]}"
        )
    if not given:
        return None
    name = given[0]
    try:
        if name == "response_format":
            params = _response_format(body["response_format"])
        elif name == "structured_outputs":
            params = StructuredOutputsParams.from_dict(_dict(body, name) or {})
        else:
            params = StructuredOutputsParams(**{name.removeprefix("guided_"): body[name]})
        if params is not None and params.grammar is not None:
            params.check()  # a grammar is not checked when built (see StructuredOutputsParams.check)
        return params
    except LineError:
        raise
    except (ValueError, TypeError) as exc:
        raise _field_error(name, exc) from None


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict):
        raise LineError(
            f"body.response_format must be a JSON object with a type, got {clipped(json.dumps(fmt))}",
            param="body.response_format",
        )
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise LineError(
                f"body.response_format.json_schema.schema must be a JSON schema object, got {json.dumps(schema)[:80]}",
                param="body.response_format.json_schema.schema",
            )
        return StructuredOutputsParams(json=schema)
    raise LineError(
        f"body.response_format.type must be text, json_object or json_schema, got {shown(kind)}",
        param="body.response_format.type",
    )


def _sampling(body: dict, max_tokens: int | None, logprobs: int | None, aliases: dict[str, str]) -> SamplingParams:
    """The body's :class:`~dfllm.SamplingParams` (OpenAI's defaults: temperature 1, top_p 1);
    a refused value names the body field (``aliases``: SamplingParams field -> body field)."""
    if body.get("stream"):
        raise LineError(_STREAM_ERROR, param="body.stream")
    values: dict[str, Any] = {
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "n": _int(body, "n", 1),
        "structured_outputs": _structured(body),
    }
    for name in (
        "temperature",
        "top_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "stop",
        *VLLM_SAMPLING,
    ):
        if body.get(name) is not None:
            values[name] = body[name]
    try:
        return SamplingParams(**values)
    except InvalidRequestError as exc:
        raise _field_error(aliases.get(exc.parameter or "", exc.parameter) or _culprit(values), exc) from None
    except (ValueError, TypeError, OverflowError) as exc:
        culprit = _culprit(values)
        raise _field_error(aliases.get(culprit or "", culprit), exc) from None


def _field_error(name: str | None, exc: Exception) -> LineError:
    """``exc`` as the line's error, naming the body field ``name`` (when known)."""
    if not name:
        return LineError(str(exc))
    return LineError(f"body.{name}: {exc}", param=f"body.{name}")


def _culprit(values: dict[str, Any]) -> str | None:
    """The first of ``values`` (SamplingParams fields) that SamplingParams refuses on its own."""
    for name, value in values.items():
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except Exception:  # noqa: BLE001  (any refusal names the field)
            return name
    return None


def _beam(body: dict, max_tokens: int | None, limit_field: str) -> tuple[BeamSearchParams, SamplingParams] | None:
    """The line's beam search, as vLLM's server maps a body onto ``BeamSearchParams`` (``n`` the
    width, ``best_of`` ignored, ``temperature`` default 1), and the SamplingParams its prompt is
    checked with (:meth:`~dfllm.BeamSearchParams.check_params`, with the line's limit,
    truncation and special-token decoding); None without ``use_beam_search``. The
    ``BeamSearchParams``' ``max_tokens`` is the line's limit, or 1 when it has none (a chat
    line: the context left, set when it runs)."""
    if not _bool(body, "use_beam_search", False):
        penalty = body.get("length_penalty")
        if penalty is not None and penalty != 1:
            raise LineError(
                "body.length_penalty applies to beam search only; set body.use_beam_search to true",
                param="body.length_penalty",
            )
        return None
    if body.get("stream"):
        raise LineError(_STREAM_ERROR, param="body.stream")
    for name, neutral in BEAM_REFUSED.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
            raise LineError(
                f"body.{name}: beam search (body.use_beam_search) does not take {name} (got "
                f"{json.dumps(value)[:60]}); it takes n (the beam width), max_tokens, temperature, "
                "length_penalty, ignore_eos, include_stop_str_in_output, logprobs and an output constraint",
                param=f"body.{name}",
            )
    values: dict[str, Any] = {
        "beam_width": _int(body, "n", 1, low=1),
        "max_tokens": max_tokens or 1,
        "ignore_eos": _bool(body, "ignore_eos", False),
        "temperature": BEAM_TEMPERATURE if body.get("temperature") is None else body["temperature"],
        "length_penalty": 1.0 if body.get("length_penalty") is None else body["length_penalty"],
        "include_stop_str_in_output": _bool(body, "include_stop_str_in_output", False),
        "structured_outputs": _structured(body),
    }
    if max_tokens is not None and max_tokens < 1:
        raise LineError(f"body.{limit_field} must be at least 1, got {max_tokens}", param=f"body.{limit_field}")
    try:
        beam = BeamSearchParams(**values)
    except ValueError as exc:  # its message starts with the field's name
        names = ("temperature", "length_penalty", "beam_width", "max_tokens")
        culprit = next((k for k in names if str(exc).startswith(k)), None)
        raise _field_error({"beam_width": "n", "max_tokens": limit_field}.get(culprit or "", culprit), exc) from None
    try:
        check = dataclasses.replace(
            beam.check_params(),
            max_tokens=max_tokens,
            truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
            skip_special_tokens=_bool(body, "skip_special_tokens", True),
        )
    except (ValueError, TypeError) as exc:
        raise _field_error("truncate_prompt_tokens", exc) from None
    return beam, check


# ---- the requests ---------------------------------------------------------------------------------------
@dataclass
class ChatCompletionRequest:
    """A ``/v1/chat/completions`` body: the conversation, its sampling params and its chat
    template options. ``logprobs``/``top_logprobs`` ask for each generated token's
    log-probability and that many alternatives."""

    messages: list[dict]
    params: SamplingParams
    logprobs: bool = False
    top_logprobs: int = 0
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    model: str | None = None
    body: dict = field(default_factory=dict, repr=False)
    beam: BeamSearchParams | None = None  # use_beam_search: the line's beam search (see _beam)

    FIELDS = (
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "tool_choice",
        "modalities",
        "function_call",
        "echo",
    ) + SAMPLING

    @classmethod
    def from_body(cls, body: dict, url: str = "/v1/chat/completions") -> ChatCompletionRequest:
        _check_fields(body, cls.FIELDS, url)
        messages = _check_messages(body.get("messages"))
        for name, what in (("tool_choice", "tool calling"), ("function_call", "function calling")):
            if body.get(name) not in (None, "none", "auto"):
                raise LineError(f"body.{name}: {what} is not supported by dfllm", param=f"body.{name}")
        modalities = body.get("modalities")
        if modalities not in (None, ["text"]):
            raise LineError(
                f'body.modalities: only ["text"] is supported, got {clipped(json.dumps(modalities))}',
                param="body.modalities",
            )
        if body.get("echo"):
            raise LineError("body.echo: echoing the prompt is not supported for chat", param="body.echo")
        limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        logprobs = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, low=0)
        if top is not None and not logprobs:
            raise LineError("body.top_logprobs needs body.logprobs set to true", param="body.top_logprobs")
        limit = _int(body, limit_name)
        beam = _beam(body, limit, limit_name)
        aliases = {"max_tokens": limit_name, "logprobs": "top_logprobs"}
        params = beam[1] if beam is not None else _sampling(body, limit, (top or 0) if logprobs else None, aliases)
        template_kwargs = _dict(body, "chat_template_kwargs")
        for name in template_kwargs or {}:
            if name in TEMPLATE_ARGUMENTS:
                raise LineError(
                    f"body.chat_template_kwargs.{name}: {name} is the chat template's own argument (set by "
                    "the request); it cannot be given in chat_template_kwargs",
                    param=f"body.chat_template_kwargs.{name}",
                )
        add = _bool(body, "add_generation_prompt", True)
        cont = _bool(body, "continue_final_message", False)
        if add and cont:  # vLLM's rule: continuing the last message means no generation prompt
            if body.get("add_generation_prompt") is True:
                raise LineError(
                    "body.continue_final_message and body.add_generation_prompt cannot both be true",
                    param="body.continue_final_message",
                )
            add = False
        return cls(
            messages,
            params,
            logprobs,
            top or 0,
            _str(body, "chat_template"),
            template_kwargs,
            add,
            cont,
            body.get("model"),
            body,
            None if beam is None else beam[0],
        )

    def sampling_params(self) -> SamplingParams:
        """The request's sampling params, for :meth:`dfllm.LLM.chat` (a beam search line's:
        what its prompt is checked with)."""
        return self.params

    def param_fields(self) -> dict[str, str]:
        """The body field of each sampling param whose name differs (for the engine's errors)."""
        fields = {"logprobs": "top_logprobs"}
        if self.body.get("max_completion_tokens") is not None:
            fields["max_tokens"] = "max_completion_tokens"
        constraint = constraint_field(self.body)
        if constraint is not None:
            fields["structured_outputs"] = constraint
        if self.beam is not None:  # a beam search asks its steps for 2 * n logprobs
            fields["logprobs"] = "n"
        return fields

    def chat_kwargs(self) -> dict:
        """The keyword arguments of :meth:`dfllm.LLM.chat` this request sets."""
        return {
            "chat_template": self.chat_template,
            "chat_template_kwargs": self.chat_template_kwargs,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


@dataclass
class CompletionRequest:
    """A ``/v1/completions`` body: one or more prompts (text or token ids) and their
    sampling params; ``echo`` puts the prompt before each completion; ``logprobs`` (an int)
    asks for that many alternatives per generated token."""

    prompts: list
    params: SamplingParams
    echo: bool = False
    logprobs: int | None = None
    model: str | None = None
    body: dict = field(default_factory=dict, repr=False)
    beam: BeamSearchParams | None = None  # use_beam_search: the line's beam search (see _beam)

    FIELDS = ("prompt", "max_tokens", "echo", "logprobs", "best_of") + SAMPLING

    @classmethod
    def from_body(cls, body: dict, url: str = "/v1/completions") -> CompletionRequest:
        _check_fields(body, cls.FIELDS, url)
        prompts = _texts_or_ids(body.get("prompt"), "prompt")
        logprobs = _int(body, "logprobs", None, low=0)
        best_of = _int(body, "best_of", None, low=1)
        limit = _int(body, "max_tokens", 16)
        beam = _beam(body, limit, "max_tokens")
        if best_of is not None and beam is None and best_of != _int(body, "n", 1):  # beam search ignores it
            raise LineError(
                f"body.best_of={best_of}: dfllm returns the n completions it samples, with no best-of "
                "selection; leave best_of out or equal to n",
                param="body.best_of",
            )
        echo = _bool(body, "echo", False)
        if echo and logprobs is not None:
            raise LineError(
                "body.echo with body.logprobs is not supported (prompt log-probabilities)", param="body.echo"
            )
        params = beam[1] if beam is not None else _sampling(body, limit, logprobs, {})
        return cls(prompts, params, echo, logprobs, body.get("model"), body, None if beam is None else beam[0])

    def sampling_params(self) -> SamplingParams:
        """The request's sampling params, for :meth:`dfllm.LLM.generate`."""
        return self.params

    def param_fields(self) -> dict[str, str]:
        """The body field of each sampling param whose name differs (for the engine's errors)."""
        constraint = constraint_field(self.body)
        fields = {} if constraint is None else {"structured_outputs": constraint}
        if self.beam is not None:  # a beam search asks its steps for 2 * n logprobs
            fields["logprobs"] = "n"
        return fields


@dataclass
class EmbeddingRequest:
    """A ``/v1/embeddings`` body: one or more inputs (text or token ids)."""

    inputs: list
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    model: str | None = None

    FIELDS = ("input", "encoding_format", "dimensions", "truncate_prompt_tokens", "normalize")

    @classmethod
    def from_body(cls, body: dict, url: str = "/v1/embeddings") -> EmbeddingRequest:
        _check_fields(body, cls.FIELDS, url)
        inputs = _texts_or_ids(body.get("input"), "input")
        for i, text in enumerate(inputs):
            if text == "":  # as OpenAI: an empty text has no embedding
                where = "body.input" if isinstance(body.get("input"), str) else f"body.input[{i}]"
                raise LineError(f"{where} is empty; an input must be a non-empty string or token ids", param=where)
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise LineError(
                f"body.encoding_format must be float or base64, got {shown(fmt)}", param="body.encoding_format"
            )
        truncate = _int(body, "truncate_prompt_tokens")
        try:
            PoolingParams(truncate_prompt_tokens=truncate)
        except ValueError as exc:
            raise _field_error("truncate_prompt_tokens", exc) from None
        return cls(inputs, fmt, _int(body, "dimensions", None, low=1), truncate, body.get("model"))


def _text_list(body: dict, name: str) -> list[str]:
    value = body.get(name)
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise LineError(
            f"body.{name} must be a string or a non-empty list of strings, got "
            f"{'nothing' if value is None else json.dumps(value)[:80]}",
            param=f"body.{name}",
        )
    return texts


@dataclass
class ScoreRequest:
    """A ``/v1/score`` body (vLLM's): the pairs of ``text_1`` and ``text_2`` to score, one
    to one, one to many or many to many (lists of equal length, pairwise)."""

    text_1: list[str]
    text_2: list[str]
    truncate_prompt_tokens: int | None = None
    model: str | None = None

    FIELDS = ("text_1", "text_2", "truncate_prompt_tokens")

    @classmethod
    def from_body(cls, body: dict, url: str = "/v1/score") -> ScoreRequest:
        _check_fields(body, cls.FIELDS, url)
        left, right = _text_list(body, "text_1"), _text_list(body, "text_2")
        if len(left) > 1 and len(left) != len(right):
            raise LineError(
                f"body.text_1 has {len(left)} texts and body.text_2 {len(right)}: give one text_1, or "
                "as many as text_2",
                param="body.text_2",
            )
        return cls(left, right, _int(body, "truncate_prompt_tokens"), body.get("model"))

    def pairs(self) -> list[tuple[str, str]]:
        left = self.text_1 * len(self.text_2) if len(self.text_1) == 1 else self.text_1
        return list(zip(left, self.text_2))


@dataclass
class RerankRequest:
    """A ``/v1/rerank`` body: a query and the documents to rank by relevance to it;
    ``top_n`` (0 or null: all) of them are returned, best first."""

    query: str
    documents: list[str]
    top_n: int = 0
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    model: str | None = None

    FIELDS = ("query", "documents", "top_n", "return_documents", "truncate_prompt_tokens")

    @classmethod
    def from_body(cls, body: dict, url: str = "/v1/rerank") -> RerankRequest:
        _check_fields(body, cls.FIELDS, url)
        query = _str(body, "query", required=True)
        docs = body.get("documents")
        if not isinstance(docs, list) or not docs:
            raise LineError("body.documents must be a non-empty list of texts", param="body.documents")
        texts = []
        for i, d in enumerate(docs):
            text = d.get("text") if isinstance(d, dict) else d
            if not isinstance(text, str):
                raise LineError(
                    f'body.documents[{i}] must be a string or {{"text": ...}}, got {json.dumps(d)[:60]}',
                    param=f"body.documents[{i}]",
                )
            texts.append(text)
        assert query is not None
        return cls(
            query,
            texts,
            _int(body, "top_n", 0, low=0) or 0,
            _bool(body, "return_documents", True),
            _int(body, "truncate_prompt_tokens"),
            body.get("model"),
        )


REQUESTS: dict[str, Any] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "embeddings": EmbeddingRequest,
    "score": ScoreRequest,
    "rerank": RerankRequest,
}


def parse_body(endpoint: str, body: dict, url: str):
    """``body`` checked as a request of ``endpoint`` (``chat``, ``completions``,
    ``embeddings``, ``score``, ``rerank``); :class:`LineError` naming the field otherwise."""
    return REQUESTS[endpoint].from_body(body, url)
