"""Reasoning parsers: a thinking model's output split into its reasoning and its answer.

Thinking models (Qwen3, DeepSeek-R1, QwQ) write their reasoning between ``<think>`` and
``</think>`` before the answer. ``LLM(reasoning_parser="qwen3")`` (or ``"deepseek_r1"``), the
dataframe methods' and the processor's ``reasoning_parser=`` engine argument and ``dfllm run
--reasoning-parser`` name one of the parsers below, with vLLM's names and rules (vLLM's
``vllm/reasoning``): each completion's reasoning goes to ``CompletionOutput.reasoning_content``
and only the answer stays in its ``text``; structured outputs constrain the answer only, the
grammar engaging after the end of the reasoning (:class:`dfllm.engine.structured.SequenceGrammar`).

A parser reads text (:meth:`ReasoningParser.extract_reasoning`, as vLLM's non-streaming chat
responses do) and token ids (:meth:`~ReasoningParser.is_reasoning_end`, which the structured
outputs ask of the prompt and then of each new token). The registry maps names to classes:
:func:`get_reasoning_parser` (an unknown name is a ``ValueError`` listing the known ones),
:func:`register_reasoning_parser` (a decorator, for a parser of your own).

The rules, as vLLM's current parsers have them:

- ``deepseek_r1`` (:class:`BaseThinkingReasoningParser`'s): a ``<think>`` in the output is
  dropped with everything before it; no ``</think>`` means *everything is reasoning* (the
  template put ``<think>`` in the prompt, or the output was cut short); else the reasoning is
  what comes before the first ``</think>`` and the answer what follows (None if empty).
- ``qwen3``: the same, except that with ``chat_template_kwargs={"enable_thinking": False}``
  an output without ``</think>`` is all answer, and that a ``<tool_call>`` followed by
  ``<function=``/``<function name=`` (the model calling a tool without closing its
  reasoning) ends the reasoning too (the tag starts the answer).

vLLM's offline ``LLM`` keeps the raw text (its parsers serve the OpenAI server); dfllm splits
it everywhere a parser is named. Streaming extraction is not provided (dfllm does not stream).
"""

from __future__ import annotations

import copy
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Seq
from functools import cached_property
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase


class ReasoningParser(ABC):
    """Splits a thinking model's output into reasoning and answer (vLLM's interface).

    ``chat_template_kwargs`` are the variables the prompt was rendered with (Qwen3 reads
    ``enable_thinking``); :meth:`for_request` gives a parser for another request's.
    """

    #: the name it is registered under (set by :func:`register_reasoning_parser`)
    name: str = ""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *args: Any,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        self.model_tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @cached_property
    def vocab(self) -> dict[str, int]:
        """The tokenizer's vocabulary (added tokens included), read once."""
        return self.model_tokenizer.get_vocab()

    def for_request(self, chat_template_kwargs: Mapping[str, Any] | None) -> ReasoningParser:
        """This parser for a request rendered with ``chat_template_kwargs`` (self when they do
        not change what it does); the vocabulary is shared, not read again."""
        return self

    @property
    def key(self) -> tuple:
        """What decides this parser's splits (requests computed once share it)."""
        return (type(self).__name__,)

    @abstractmethod
    def is_reasoning_end(self, input_ids: Seq[int]) -> bool:
        """Whether the reasoning has ended by the end of ``input_ids`` (a prompt, or a prompt
        and its output so far): structured outputs engage only once it has."""

    def is_reasoning_end_streaming(self, input_ids: Seq[int], delta_ids: Iterable[int]) -> bool:
        """Whether the reasoning ends in ``delta_ids``, the newest tokens of ``input_ids``."""
        return self.is_reasoning_end(input_ids)

    @abstractmethod
    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The token ids of the answer in ``input_ids`` (an output)."""

    def count_reasoning_tokens(self, token_ids: Seq[int]) -> int:
        """How many of ``token_ids`` are reasoning; 0 unless a parser counts them (vLLM's default)."""
        return 0

    @abstractmethod
    def extract_reasoning(self, model_output: str, request: Any = None) -> tuple[str | None, str | None]:
        """``(reasoning, answer)`` of a whole output's text; either may be None."""


class BaseThinkingReasoningParser(ReasoningParser):
    """A parser for reasoning between a start and an end token (``<think>``...``</think>``).

    Both markers must be single tokens of the tokenizer: a tokenizer without them is a
    ``ValueError`` naming the parser, at construction.
    """

    start_token: str = "<think>"
    end_token: str = "</think>"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *args: Any,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(tokenizer, *args, chat_template_kwargs=chat_template_kwargs, **kwargs)
        if tokenizer is None:
            raise ValueError(f"reasoning_parser={self.name!r} needs the model's tokenizer")
        start, end = self.vocab.get(self.start_token), self.vocab.get(self.end_token)
        if start is None or end is None:
            missing = [t for t, i in ((self.start_token, start), (self.end_token, end)) if i is None]
            raise ValueError(
                f"reasoning_parser={self.name!r}: the tokenizer has no token {' or '.join(missing)} "
                f"({self.start_token!r} and {self.end_token!r} must each be one token of its "
                "vocabulary); is this a thinking model?"
            )
        self.start_token_id: int = start
        self.end_token_id: int = end

    def is_reasoning_end(self, input_ids: Seq[int]) -> bool:
        """The last of the start and end tokens in ``input_ids`` decides: the end token means
        ended, the start token (or neither) not."""
        for token in reversed(input_ids):
            if token == self.start_token_id:
                return False
            if token == self.end_token_id:
                return True
        return False

    def is_reasoning_end_streaming(self, input_ids: Seq[int], delta_ids: Iterable[int]) -> bool:
        """Whether the end token is among the newest tokens (one scan of the delta, not of the
        whole sequence: the engine asks at every step until the reasoning ends)."""
        return self.end_token_id in set(delta_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The ids after the first end token; none if it is absent or only the last token."""
        if self.end_token_id not in input_ids[:-1]:
            return []
        return input_ids[input_ids.index(self.end_token_id) + 1 :]

    def extract_reasoning(self, model_output: str, request: Any = None) -> tuple[str | None, str | None]:
        """A start token and what precedes it are dropped; without an end token everything
        (left) is reasoning; else reasoning before the first end token, answer after (None
        when empty)."""
        before, start, after = model_output.partition(self.start_token)
        model_output = after if start else before
        if self.end_token not in model_output:
            return model_output, None
        reasoning, _, content = model_output.partition(self.end_token)
        return reasoning, content or None


_R = TypeVar("_R", bound=type[ReasoningParser])
_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(*names: str) -> Callable[[_R], _R]:
    """A class decorator registering a :class:`ReasoningParser` under ``names`` (vLLM's
    ``ReasoningParserManager.register_module``); a later class replaces an earlier one."""

    def register(cls: _R) -> _R:
        if not (isinstance(cls, type) and issubclass(cls, ReasoningParser)):
            raise TypeError(f"a reasoning parser must subclass ReasoningParser, got {cls!r}")
        if not names:
            raise ValueError("register_reasoning_parser needs at least one name")
        cls.name = names[0]
        for n in names:
            _PARSERS[n] = cls
        return cls

    return register


def reasoning_parser_names() -> list[str]:
    """The registered parsers' names, sorted."""
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; ``ValueError`` naming ``reasoning_parser`` and
    listing the known names for any other."""
    if not isinstance(name, str) or name not in _PARSERS:
        raise ValueError(
            f"reasoning_parser={name!r} is not a known reasoning parser; choose one of {reasoning_parser_names()}"
        )
    return _PARSERS[name]


def check_reasoning_parser(name: Any) -> str | None:
    """vLLM's ``reasoning_parser`` engine argument as a parser name, None for none (None or
    ``""``, vLLM's default); ``ValueError`` for an unknown one."""
    if name is None or name == "":
        return None
    get_reasoning_parser(name)
    return name


def reasoning_settings(reasoning_parser: Any, structured_outputs_config: Mapping | None) -> tuple[str | None, bool]:
    """``(parser name or None, enable_in_reasoning)`` from vLLM's engine arguments:
    ``reasoning_parser``, else ``structured_outputs_config["reasoning_parser"]`` (vLLM keeps it
    there; the argument wins, as in vLLM), and ``structured_outputs_config["enable_in_reasoning"]``
    (default False: the grammar engages after the reasoning)."""
    config = dict(structured_outputs_config or {})
    name = check_reasoning_parser(reasoning_parser) or check_reasoning_parser(config.get("reasoning_parser"))
    return name, bool(config.get("enable_in_reasoning", False))


def reasoning_parser_of(engine_kwargs: Mapping[str, Any]) -> str | None:
    """The parser that the engine arguments of a dataframe call or a processor name (None
    for none): those calls add a ``reasoning_content`` column when there is one."""
    config = engine_kwargs.get("structured_outputs_config")
    return reasoning_settings(engine_kwargs.get("reasoning_parser"), config if isinstance(config, Mapping) else None)[0]


def make_reasoning_parser(
    name: str, tokenizer: PreTrainedTokenizerBase | None, chat_template_kwargs: Mapping[str, Any] | None = None
) -> ReasoningParser:
    """Parser ``name`` for ``tokenizer``; ``ValueError`` for an unknown name, no tokenizer
    (``skip_tokenizer_init=True``) or a tokenizer without the parser's markers."""
    cls = get_reasoning_parser(name)
    if tokenizer is None:
        raise ValueError(
            f"reasoning_parser={name!r} reads the output's text and tokens and needs the tokenizer; "
            "it cannot be used with skip_tokenizer_init=True"
        )
    return cls(tokenizer, chat_template_kwargs=chat_template_kwargs)


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    """DeepSeek-R1 (and QwQ-32B): ``<think>``...``</think>``, the base rules. R1's template puts
    ``<think>`` in the prompt, so the output usually starts with the reasoning, and an output
    without ``</think>`` is all reasoning."""


_FUNCTION_OPEN = re.compile(r"<function[\s=]")


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    """Qwen3 (and Qwen3.5, QwQ): ``<think>``...``</think>``, with ``enable_thinking``.

    A generated ``<think>`` is dropped (older templates let the model write it; newer ones put
    it in the prompt). With ``chat_template_kwargs={"enable_thinking": False}`` (the template
    then puts ``<think>\\n\\n</think>\\n\\n`` in the prompt) an output without ``</think>`` is
    all answer. A ``<tool_call>`` followed (after whitespace) by ``<function=`` or
    ``<function name=`` ends the reasoning as ``</think>`` would, the tag starting the answer;
    a ``<tool_call>`` merely mentioned in the reasoning does not.
    """

    _tool_call_tag = "<tool_call>"
    _tool_call_end_tag = "</tool_call>"
    #: tokens decoded after a <tool_call> to look for "<function" (vLLM's window)
    _FUNCTION_LOOKAHEAD_TOKENS = 8

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *args: Any,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(tokenizer, *args, chat_template_kwargs=chat_template_kwargs, **kwargs)
        self.thinking_enabled = bool(self.chat_template_kwargs.get("enable_thinking", True))
        self._tool_call_token_id = self.vocab.get(self._tool_call_tag)
        self._tool_call_end_token_id = self.vocab.get(self._tool_call_end_tag)

    def for_request(self, chat_template_kwargs: Mapping[str, Any] | None) -> ReasoningParser:
        thinking = bool((chat_template_kwargs or {}).get("enable_thinking", True))
        if thinking == self.thinking_enabled:
            return self
        parser = copy.copy(self)
        parser.chat_template_kwargs = dict(chat_template_kwargs or {})
        parser.thinking_enabled = thinking
        return parser

    @property
    def key(self) -> tuple:
        return (type(self).__name__, self.thinking_enabled)

    def _tool_call_is_genuine_end(self, input_ids: Seq[int], tool_call_pos: int) -> bool:
        """Whether ``<function=``/``<function name=`` follows the ``<tool_call>`` at
        ``tool_call_pos`` within the next few tokens (False when none follow)."""
        after = list(input_ids[tool_call_pos + 1 : tool_call_pos + 1 + self._FUNCTION_LOOKAHEAD_TOKENS])
        if not after:
            return False
        try:
            text = self.model_tokenizer.decode(after, skip_special_tokens=False)
        except Exception:  # noqa: BLE001 (as vLLM: an undecodable window is no tool call)
            return False
        return bool(_FUNCTION_OPEN.match(str(text).lstrip()))

    def is_reasoning_end(self, input_ids: Seq[int]) -> bool:
        """The base rule, plus: an unpaired ``<tool_call>`` (no ``</tool_call>`` after it)
        followed by a function tag ends the reasoning."""
        tc, tc_end = self._tool_call_token_id, self._tool_call_end_token_id
        for i in range(len(input_ids) - 1, -1, -1):
            token = input_ids[i]
            if token == self.start_token_id:
                return False
            if token == self.end_token_id:
                return True
            if tc is not None and token == tc:
                if tc_end is not None and tc_end in input_ids[i + 1 :]:
                    continue  # a paired one: an example in the prompt
                if self._tool_call_is_genuine_end(input_ids, i):
                    return True
        return False

    def is_reasoning_end_streaming(self, input_ids: Seq[int], delta_ids: Iterable[int]) -> bool:
        delta = set(delta_ids)
        if self.end_token_id in delta:
            return True
        tc = self._tool_call_token_id
        if tc is not None and tc in delta:
            ids = list(input_ids)
            return self._tool_call_is_genuine_end(ids, len(ids) - 1 - ids[::-1].index(tc))
        return False

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The base rule; failing that, the ids from the last ``<tool_call>`` on."""
        content = super().extract_content_ids(input_ids)
        if content:
            return content
        tc = self._tool_call_token_id
        if tc is not None and tc in input_ids:
            return input_ids[len(input_ids) - 1 - input_ids[::-1].index(tc) :]
        return []

    def extract_reasoning(self, model_output: str, request: Any = None) -> tuple[str | None, str | None]:
        """A generated ``<think>`` is dropped (with what precedes it); a ``</think>`` splits;
        without one: all answer if thinking is disabled, else split at a genuine
        ``<tool_call>`` (reasoning and answer None when empty), else all reasoning."""
        before, start, after = model_output.partition(self.start_token)
        model_output = after if start else before
        if self.end_token in model_output:
            reasoning, _, content = model_output.partition(self.end_token)
            return reasoning, content or None
        if not self.thinking_enabled:
            return None, model_output
        at = model_output.find(self._tool_call_tag)
        if at != -1 and _FUNCTION_OPEN.match(model_output[at + len(self._tool_call_tag) :].lstrip()):
            return model_output[:at] or None, model_output[at:] or None
        return model_output, None
