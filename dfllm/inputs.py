"""Normalising the prompts and conversations given to :class:`dfllm.LLM`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from dfllm.errors import MAX_NESTING_DEPTH, nesting_depth, value_text
from dfllm.sampling_params import SamplingParams

VALID_ROLES = ("system", "user", "assistant", "tool", "developer")

# vLLM 0.32's words (vllm/renderers/inputs/preprocess.py) for a prompt that is not a str, a
# list of token ids or a dict (None, a float): dfllm's messages start with them
PROMPT_TYPE_ERROR = "Prompt should be a string, list of tokens, or dictionary"


@dataclass
class TokenizedPrompt:
    """A prompt's text (None if given as token ids only) and token ids; a rendered chat also
    keeps the template variables it was rendered with (a reasoning parser reads them) and
    ``chat=True`` (its tokens come from its rendered text, whose length vLLM checks as a text prompt's)."""

    prompt: str | None
    token_ids: list[int]
    chat_template_kwargs: dict | None = None
    chat: bool = False


def as_prompt_list(prompts) -> list:
    """One prompt or a list of them; each a str or a dict with ``prompt`` / ``prompt_token_ids``."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts is None or not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be a str, a dict or a list of them, got {type(prompts).__name__}")
    if isinstance(prompts, Seq) and prompts and all(isinstance(p, int) for p in prompts):
        raise ValueError('token-id prompts must be given as {"prompt_token_ids": [...]}')
    return list(prompts)


def check_unicode(text: str, what: str) -> str:
    """``text`` unchanged; ``ValueError`` naming ``what`` if it holds a lone surrogate, which
    no tokenizer can encode (it is not valid Unicode, so it has no UTF-8 form)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} is not valid Unicode: lone surrogate {text[exc.start]!r} at character {exc.start}"
        ) from None
    return text


def per_prompt_params(params, n: int, cls: type = SamplingParams, name: str = "sampling_params") -> list:
    """One ``cls`` object per prompt from None (defaults), one object, or a list of length ``n``."""
    if params is None:
        return [cls()] * n
    if isinstance(params, cls):
        return [params] * n
    params = list(params)
    if len(params) != n:  # vLLM 0.32's words (vllm/entrypoints/common/offline.py, ``_params_to_seq``), then dfllm's
        raise ValueError(
            f"The lengths of prompts ({n}) and params ({len(params)}) must be the same. (got "
            f"{len(params)} {name} for {n} prompts)"
        )
    for i, p in enumerate(params):
        if not isinstance(p, cls):
            raise ValueError(f"{name}[{i}] must be a {cls.__name__}, got {type(p).__name__}")
    return params


def as_conversation_list(messages) -> list[list[dict]]:
    """One conversation (a list of messages) or a list of conversations, checked."""
    if not isinstance(messages, Seq) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a conversation (list of {'role', 'content'} dicts) or a list of them")
    convs = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conv in enumerate(convs):
        check_conversation(conv, f"conversation {i}")
    return [list(c) for c in convs]


def check_conversation(conv, name: str) -> None:
    """Raise ``ValueError`` naming the conversation (``name``: ``"conversation 2"`` of a call's
    conversations, ``"the conversation"`` of a dataframe row, whose error is its own) and the
    message that is malformed. A message's field nested more than
    :data:`~dfllm.errors.MAX_NESTING_DEPTH` levels deep is refused by name (:func:`check_nesting`:
    the chat template and these checks walk it, and one nested past Python's limit would fail
    the call or the dataframe's partition)."""
    if not isinstance(conv, Seq) or isinstance(conv, str) or not conv:
        raise ValueError(f"{name} must be a non-empty list of messages")
    for j, msg in enumerate(conv):
        where = f"{name}, message {j}"
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: a message must be a dict, got {type(msg).__name__}")
        check_nesting(msg, where)
        if msg.get("role") not in VALID_ROLES:
            raise ValueError(f"{where}: role must be one of {VALID_ROLES}, got {msg.get('role')!r}")
        content = msg.get("content")
        if not isinstance(content, str) and not _is_text_parts(content):
            raise ValueError(f"{where}: content must be a str or a list of text parts, got {type(content).__name__}")
        parts: list = [] if isinstance(content, str) or content is None else list(content)
        for text in [content] if isinstance(content, str) else [p["text"] for p in parts if p["type"] == "text"]:
            check_unicode(text, f"{where}: content")


def check_nesting(fields: Mapping, where: str, what: str = "field") -> None:
    """``ValueError`` naming the first of ``fields`` (a message's fields, or a chat template's
    variables) whose containers nest more than :data:`~dfllm.errors.MAX_NESTING_DEPTH` levels
    deep; ``where`` names what holds them (``"the conversation, message 0"``) and ``what``
    each of them (``"field"``, ``"variable"``)."""
    for key, value in fields.items():
        if nesting_depth(value) > MAX_NESTING_DEPTH:
            raise ValueError(
                f"{where}: {what} {value_text(key)!r} must be nested at most {MAX_NESTING_DEPTH} levels deep"
            )


def _is_text_parts(content) -> bool:
    """A list of text parts, and image parts (``image_url``, ``image_pil``, ``image``: a
    vision-language model takes them, any other model refuses them naming the conversation)."""
    return isinstance(content, list) and all(
        isinstance(p, dict)
        and (
            (p.get("type") == "text" and isinstance(p.get("text"), str))
            or p.get("type") in ("image_url", "image_pil", "image")
        )
        for p in content
    )
