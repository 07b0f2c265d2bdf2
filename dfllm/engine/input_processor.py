"""Turning what a caller gives into requests the engine can run: the one place inputs are checked.

A prompt (text, ``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``, or a conversation
rendered with the chat template) becomes an :class:`EngineRequest`: token ids checked
against the vocabulary and ``max_model_len``, sampling params checked against the model,
and a structured-output constraint compiled. Whoever adds requests to the engine
(``LLM.generate``/``chat``/``enqueue``, the dataframe accessors' driver) builds them here,
so a bad input raises :class:`~dfllm.errors.InvalidRequestError` (a ``ValueError``) naming
it before the engine sees it, and :meth:`~dfllm.engine.llm_engine.LLMEngine.add_request`
checks nothing again. Messages start with vLLM's words for the same failure ("Prompt cannot
be empty", "Token id N is out of vocabulary", "The decoder prompt (length N) is longer than
the maximum model length of L", "Requested sample logprobs of K, which is greater than max
allowed: M", "vLLM V1 does not yet support best_of.") and go on with dfllm's (which prompt,
which field).

Without a tokenizer (``LLM(skip_tokenizer_init=True)``, as vLLM) prompts are token ids and
outputs carry token ids with empty text; what needs a tokenizer (a text prompt, a chat,
stop strings, bad words, structured outputs) is refused per request.

Not thread-safe (transformers' fast tokenizers are not): callers sharing an engine
across threads serialise calls with their own lock.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import cast

from transformers import PreTrainedTokenizerBase

from dfllm.engine.structured import Grammar, GrammarCompiler
from dfllm.errors import InvalidRequestError, invalid_request
from dfllm.inputs import (
    TokenizedPrompt,
    as_conversation_list,
    as_prompt_list,
    check_unicode,
    per_prompt_params,
)
from dfllm.lora.request import LoRARequest
from dfllm.multimodal.inputs import MultiModalInputs
from dfllm.multimodal.processor import ImageInputProcessor, has_image_parts
from dfllm.reasoning import ReasoningParser, make_reasoning_parser
from dfllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """A checked prompt and its sampling params, ready for ``LLMEngine.add_request``."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: Grammar | None = None  # the compiled structured-output constraint, if any
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences
    # the engine's reasoning parser for this prompt (with the chat template variables it was rendered with)
    reasoning: ReasoningParser | None = None
    mm_inputs: MultiModalInputs | None = None  # the prompt's images (dfllm.multimodal), placeholders expanded
    # LoRA: the adapter it runs with (a dataframe row's; LLM calls pass theirs to add_request instead)
    lora_request: LoRARequest | None = None


NO_TOKENIZER = "Unable to get tokenizer because skip_tokenizer_init is True"


class InputProcessor:
    """Tokenizes, renders chat templates and checks prompts for one engine's model."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, max_model_len: int,
                 eos_token_ids: set[int], *, max_logprobs: int = -1,
                 reasoning_parser: str | ReasoningParser | None = None, mm: ImageInputProcessor | None = None):
        """``max_logprobs`` caps ``logprobs`` and ``prompt_logprobs`` of a request (vLLM's
        engine argument, ``EngineConfig.max_logprobs``); -1 allows the whole vocabulary.
        ``tokenizer`` is None under ``skip_tokenizer_init=True``. ``reasoning_parser`` (a
        :mod:`dfllm.reasoning` parser, or its name: ``ValueError`` now for an unknown one or a
        tokenizer without its markers) is given to every request, for the template variables
        it was rendered with."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_logprobs = max_logprobs
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self.reasoning = (make_reasoning_parser(reasoning_parser, tokenizer) if isinstance(reasoning_parser, str)
                          else reasoning_parser)
        self.mm = mm  # a vision-language model's images (None: text only)

    # ---- text to tokens --------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of ``texts`` (with the tokenizer's special tokens, as ``generate`` does)."""
        if not texts:
            return []
        tokenizer = self._tokenizer("You cannot pass text prompts when `skip_tokenizer_init` is True (this engine "
                                    "has no tokenizer; give token ids)", "prompt")
        return tokenizer(list(texts))["input_ids"]

    def render_chat(self, conversation: list[dict], chat_template: str | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> TokenizedPrompt:
        """One conversation rendered with the tokenizer's chat template (or ``chat_template``)
        in transformers' sandboxed Jinja environment, and tokenized."""
        tokenizer = self._tokenizer(f"{NO_TOKENIZER} (chat renders conversations with the tokenizer's chat "
                                    "template; without one, give token ids to generate)", "messages")
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("the tokenizer has no chat template; pass chat_template=...")
        # tokenize=False: the rendered text (transformers annotates every return type at once)
        if self.mm is not None:  # image parts: placeholders as the template takes them (dfllm.multimodal)
            template = chat_template or getattr(tokenizer, "chat_template", None)
            messages = [self.mm.flatten_content(m, template) for m in conversation]
        elif has_image_parts(conversation):
            raise InvalidRequestError("image parts: this model takes no images (it is a text-only model: content "
                                      "must be a str or a list of text parts)", parameter="messages")
        else:
            messages = [_flatten_content(m) for m in conversation]
        text = cast(str, tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **(chat_template_kwargs or {})))
        return TokenizedPrompt(text, tokenizer.encode(text, add_special_tokens=False),
                               dict(chat_template_kwargs) if chat_template_kwargs else None)

    def _tokenizer(self, message: str, parameter: str) -> PreTrainedTokenizerBase:
        """The tokenizer; :class:`~dfllm.errors.InvalidRequestError` with ``message`` without one."""
        if self.tokenizer is None:
            raise InvalidRequestError(message, parameter=parameter)
        return self.tokenizer

    # ---- checked requests ------------------------------------------------------------
    def process(self, prompt: TokenizedPrompt | dict | str, params: SamplingParams,
                what: str = "prompt", images: list | None = None) -> EngineRequest:
        """``prompt`` with ``params`` as a checked request; :class:`~dfllm.errors.InvalidRequestError`
        (a ``ValueError``) naming ``what`` if either is refused. A vision-language model's images
        come from the prompt's ``multi_modal_data`` or, for a chat, ``images`` (its image parts)."""
        with invalid_request():
            if not isinstance(params, SamplingParams):
                raise InvalidRequestError(f"{what}: sampling params must be a SamplingParams, got "
                                          f"{type(params).__name__}", parameter="sampling_params")
            tokenized = self._tokenized(prompt, what)
            tokenized, mm_inputs = self._with_images(prompt, tokenized, images, params, what)
            keep = params.truncate_prompt_tokens
            if keep is not None:  # the last tokens, as vLLM truncates (-1: as many as max_model_len)
                keep = self.max_model_len if keep == -1 else keep
                tokenized = TokenizedPrompt(tokenized.prompt, tokenized.token_ids[-keep:])
            check_prompt_length(len(tokenized.token_ids), what, self.max_model_len)
            check_params_for_model(params, what, self.vocab_size, self.max_logprobs)
            params.check_supported(what)
            if self.tokenizer is None:
                params = self._without_tokenizer(params, what)
            grammar = None if params.structured_outputs is None else self.grammars.prepare(params.structured_outputs)
            return EngineRequest(tokenized.prompt, tokenized.token_ids, params, grammar, self._bad_words_ids(params),
                                 self._reasoning(prompt), mm_inputs=mm_inputs)

    def _with_images(self, prompt, tokenized: TokenizedPrompt, images: list | None, params: SamplingParams,
                     what: str) -> tuple[TokenizedPrompt, MultiModalInputs | None]:
        """The prompt with its images' placeholder tokens expanded, and its images (see
        :class:`~dfllm.multimodal.processor.ImageInputProcessor`); a text-only model refuses images."""
        has_data = isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None
        if self.mm is None:
            if has_data or images:
                raise InvalidRequestError(f"{what}: multi_modal_data: this model takes no images (it is a text-only "
                                          "model)", parameter="multi_modal_data")
            return tokenized, None
        found, kwargs = self.mm.images_of_prompt(prompt, what)
        images = list(images or []) + found
        if images and params.truncate_prompt_tokens is not None:
            raise InvalidRequestError(f"{what}: truncate_prompt_tokens cannot be used with images (it could cut an "
                                      "image's placeholder tokens)", parameter="truncate_prompt_tokens")
        ids, mm_inputs = self.mm.process(tokenized.token_ids, images, what, kwargs)
        return TokenizedPrompt(tokenized.prompt, ids, tokenized.chat_template_kwargs), mm_inputs

    def _reasoning(self, prompt) -> ReasoningParser | None:
        """The reasoning parser for ``prompt`` (a rendered chat's template variables decide,
        e.g. Qwen3's ``enable_thinking``); None without one."""
        if self.reasoning is None:
            return None
        kwargs = prompt.chat_template_kwargs if isinstance(prompt, TokenizedPrompt) else None
        return self.reasoning.for_request(kwargs)

    @staticmethod
    def _without_tokenizer(params: SamplingParams, what: str) -> SamplingParams:
        """``params`` for an engine without a tokenizer (``skip_tokenizer_init=True``): what needs
        one is refused, naming ``what``; the rest runs with ``detokenize=False`` (token ids,
        empty text), as vLLM does."""
        if params.structured_outputs is not None:
            raise InvalidRequestError("Structured outputs requires a tokenizer so it can't be used with "
                                      f"'skip_tokenizer_init' ({what}: structured_outputs needs the tokenizer)",
                                      parameter="structured_outputs")
        for field, value in (("stop", params.stop_strings), ("bad_words", params.bad_words)):
            if value:
                raise InvalidRequestError(f"{field} cannot be used with 'skip_tokenizer_init': there is no tokenizer "
                                          f"to read the text ({what}: {field}={value!r}; stop_token_ids and "
                                          "allowed_token_ids work on token ids)", parameter=field, value=value)
        return replace(params, detokenize=False) if params.detokenize else params

    def process_prompts(self, prompts, sampling_params) -> list[EngineRequest]:
        """``LLM.generate``'s prompts (one or a list) with their params, every one checked
        before any is returned; an error names the prompt by index."""
        with invalid_request():
            items = as_prompt_list(prompts)
            params = _per_prompt(sampling_params, len(items))
            return [self.process(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(zip(items, params))]

    def process_chats(self, messages, sampling_params, chat_template: str | None = None,
                      add_generation_prompt: bool = True, continue_final_message: bool = False,
                      chat_template_kwargs: dict | None = None) -> list[EngineRequest]:
        """``LLM.chat``'s conversations (one or a list) rendered and checked; errors name the
        conversation by index."""
        with invalid_request():
            if add_generation_prompt and continue_final_message:
                raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be True")
            convs = as_conversation_list(messages)
            params = _per_prompt(sampling_params, len(convs))
            images = [self._chat_images(c, f"conversation {i}") for i, c in enumerate(convs)]
            rendered = [self.render_chat(c, chat_template, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         chat_template_kwargs=chat_template_kwargs) for c in convs]
            return [self.process(p, sp, f"prompt {i}", ims)
                    for i, (p, sp, ims) in enumerate(zip(rendered, params, images))]

    def _chat_images(self, conversation: list[dict], what: str) -> list:
        """The images of a conversation's image parts; refused by a text-only model."""
        if self.mm is None:
            if has_image_parts(conversation):
                raise InvalidRequestError(f"{what}: image parts: this model takes no images (it is a text-only "
                                          "model: content must be a str or a list of text parts)",
                                          parameter="messages")
            return []
        return self.mm.images_of_conversation(conversation, what)

    def _bad_words_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens at the start of a text and, when that tokenizes differently
        into as many tokens, after a space (vLLM's rule)."""
        out: list[tuple[int, ...]] = []
        for word in params.bad_words or []:  # refused without a tokenizer (_without_tokenizer)
            tokenizer = self._tokenizer("bad_words cannot be used with 'skip_tokenizer_init'", "bad_words")
            bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return tuple(out)

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-outputs compiler for this tokenizer and vocabulary, built on first use."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def _tokenized(self, prompt, what: str) -> TokenizedPrompt:
        if isinstance(prompt, TokenizedPrompt):
            return TokenizedPrompt(prompt.prompt, check_token_ids(prompt.token_ids, what, self.vocab_size))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return TokenizedPrompt(prompt.get("prompt"),
                                   check_token_ids(prompt["prompt_token_ids"], what, self.vocab_size))
        text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt" in prompt else prompt
        if isinstance(prompt, dict) and not isinstance(text, str) and "prompt" in prompt:
            raise InvalidRequestError(f"{what}: 'prompt' must be a str, got {type(text).__name__}")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{what}: expected a str or a dict with 'prompt' or 'prompt_token_ids', "
                                      f"got {type(prompt).__name__}")
        tokenizer = self._tokenizer("You cannot pass text prompts when `skip_tokenizer_init` is True "
                                    f"({what}: this engine has no tokenizer; give {{\"prompt_token_ids\": [...]}})",
                                    "prompt")
        ids = tokenizer.encode(check_unicode(text, what))
        return TokenizedPrompt(text, check_token_ids(ids, what, self.vocab_size))


# ---- the checks, shared with the pooling frontend (dfllm.llm_pooling) ----------------------
def check_token_ids(ids, what: str, vocab_size: int) -> list[int]:
    """The token ids of a prompt as a list; :class:`~dfllm.errors.InvalidRequestError` naming
    it (``what``, e.g. "prompt 3") if they are not ints or one is outside the vocabulary."""
    if not isinstance(ids, Seq) or isinstance(ids, str) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError(f"{what}: prompt_token_ids must be a list of ints", parameter="prompt_token_ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"Token id {bad[0]} is out of vocabulary ({what}: token id {bad[0]} is outside the "
                                  f"model's vocabulary [0, {vocab_size}))", parameter="prompt_token_ids",
                                  value=bad[0])
    return list(ids)


def check_prompt_length(n: int, what: str, max_model_len: int | None) -> None:
    """Refuse an empty prompt, and one longer than ``max_model_len`` (unless None), naming ``what``."""
    if n == 0:  # e.g. an empty string without special tokens, or a chat template that rendered nothing
        raise InvalidRequestError(f"Prompt cannot be empty. The decoder prompt cannot be empty ({what} is empty: "
                                  "no tokens)", parameter="prompt")
    if max_model_len is not None and n > max_model_len:
        raise InvalidRequestError(
            f"The decoder prompt (length {n}) is longer than the maximum model length of {max_model_len}. "
            f"Make sure that `max_model_len` is no smaller than the number of text tokens. ({what} has {n} tokens, "
            f"longer than max_model_len={max_model_len})", parameter="prompt", value=n)


def check_params_for_model(params: SamplingParams, what: str, vocab_size: int, max_logprobs: int = -1) -> None:
    """Refuse sampling params that ask more than the model has, naming the prompt (``what``):
    token ids outside the vocabulary (``allowed_token_ids``, ``logit_bias``,
    ``stop_token_ids``), and ``logprobs``/``prompt_logprobs`` above ``max_logprobs`` or the
    vocabulary size (-1 asks for the whole vocabulary; ``max_logprobs=-1`` caps at it), as vLLM."""
    allowed = sorted({t for t in params.allowed_token_ids or [] if not 0 <= t < vocab_size})
    if allowed:
        raise InvalidRequestError(
            f"allowed_token_ids contains out-of-vocab token id! ({what}: token id(s) {allowed[:5]} in "
            f"allowed_token_ids are outside the model's vocabulary [0, {vocab_size}): out of vocabulary)",
            parameter="allowed_token_ids", value=allowed)
    for field in ("logit_bias", "stop_token_ids"):
        ids: set[int] = params.all_stop_token_ids if field == "stop_token_ids" else set(params.logit_bias or ())
        bad = sorted({t for t in ids if not 0 <= t < vocab_size})
        if bad:
            raise InvalidRequestError(
                f"token_id(s) {bad} in {field} contain out-of-vocab token ids. Vocabulary size: {vocab_size} "
                f"({what}: token id(s) {bad[:5]} in {field} are outside the model's vocabulary [0, {vocab_size}))",
                parameter=field, value=bad)
    limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    for field, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        asked = getattr(params, field, None)
        if asked is None:
            continue
        k = vocab_size if asked == -1 else asked
        if k <= limit:
            continue
        why = (f"{field}={asked} exceeds the model's vocabulary of {vocab_size} tokens (use -1 for all of them)"
               if k > vocab_size else
               f"{field}={asked} exceeds max_logprobs={max_logprobs} (raise it with LLM(max_logprobs=...); -1 "
               "allows the whole vocabulary)")
        raise InvalidRequestError(f"Requested {kind} logprobs of {k}, which is greater than max allowed: {limit} "
                                  f"({what}: {why})", parameter=field, value=k)


def _per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt (see ``dfllm.inputs.per_prompt_params``); anything else
    (a PoolingParams, a dict) is refused by name."""
    if sampling_params is not None and not isinstance(sampling_params, SamplingParams | list | tuple):
        raise InvalidRequestError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                                  f"got {type(sampling_params).__name__}", parameter="sampling_params")
    return per_prompt_params(sampling_params, n)


def _flatten_content(msg: dict) -> dict:
    """A message whose content is a list of text parts, with the parts joined by newlines."""
    content = msg["content"]
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    return {**msg, "content": content}
