"""Turning what a caller gives into requests the engine can run: the one place inputs are checked.

A prompt (text, ``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``, or a conversation
rendered with the chat template) becomes an :class:`EngineRequest`: token ids checked
against the vocabulary and ``max_model_len``, sampling params checked against the model,
and a structured-output constraint compiled. Whoever adds requests to the engine
(``LLM.generate``/``chat``/``enqueue``, the dataframe accessors' driver) builds them here,
so a bad input raises :class:`~dfllm.errors.InvalidRequestError` (a ``ValueError``) naming
it before the engine sees it, and :meth:`~dfllm.engine.llm_engine.LLMEngine.add_request`
checks nothing again. Messages start with vLLM's words for the same failure ("The decoder
prompt cannot be empty", "Token id N is out of vocabulary", "This model's maximum context
length is L tokens. However, your prompt contains N input tokens, ...", "Requested sample
logprobs of K, which is greater than max allowed: M", "vLLM V1 does not yet support
best_of.") and go on with dfllm's (which prompt, which field). A pooling model's prompts
become :class:`PoolingRequest` objects (:meth:`InputProcessor.process_pooling`), truncated
rather than refused when long.

Without a tokenizer (``LLM(skip_tokenizer_init=True)``, as vLLM) prompts are token ids and
outputs carry token ids with empty text; what needs a tokenizer (a text prompt, a chat,
stop strings, bad words, structured outputs) is refused per request.

Not thread-safe (transformers' fast tokenizers are not): callers sharing an engine
across threads serialise calls with their own lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from dfllm.engine.structured import Grammar, GrammarCompiler
from dfllm.errors import InvalidRequestError, invalid_request
from dfllm.inputs import (
    PROMPT_TYPE_ERROR,
    TokenizedPrompt,
    as_conversation_list,
    as_prompt_list,
    check_nesting,
    check_unicode,
    per_prompt_params,
)
from dfllm.lora.request import LoRARequest
from dfllm.multimodal.inputs import MultiModalInputs
from dfllm.multimodal.processor import ImageInputProcessor, has_image_parts
from dfllm.pooling_params import PoolingParams
from dfllm.reasoning import ReasoningParser, make_reasoning_parser
from dfllm.sampling_params import SamplingParams
from dfllm.structured_outputs import with_engine_defaults


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


@dataclass(frozen=True)
class ImagePrompt:
    """An image to embed (decoded) and its content hash (:func:`dfllm.multimodal.image_hash`)."""

    image: Any  # PIL.Image.Image
    hash: str


@dataclass(frozen=True)
class PoolingRequest:
    """A checked pooling prompt (its token ids, truncated, or an image) and its params, for ``PoolingEngine``."""

    prompt_token_ids: list[int]  # [] for an image
    params: PoolingParams
    token_type_ids: list[int] | None = None  # a cross-encoder pair's segment of each token
    image: ImagePrompt | None = None  # the image to embed (an image-text model)


NO_TOKENIZER = "Unable to get tokenizer because skip_tokenizer_init is True"


class InputProcessor:
    """Tokenizes, renders chat templates and checks prompts for one engine's model."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: set[int],
        *,
        max_logprobs: int = -1,
        structured_defaults: tuple[bool | None, bool] = (None, False),
        reasoning_parser: str | ReasoningParser | None = None,
        mm: ImageInputProcessor | None = None,
        embeds_images: bool = False,
        model_name: str = "this model",
    ):
        """``max_logprobs`` caps ``logprobs`` and ``prompt_logprobs`` of a request (vLLM's
        engine argument, ``EngineConfig.max_logprobs``); -1 allows the whole vocabulary.
        ``structured_defaults``: ``(disable_any_whitespace, disable_additional_properties)`` of vLLM's
        ``structured_outputs_config``, for the structured outputs of every request.
        A pooling model's (``model_name``'s) ``max_model_len`` is its input limit; ``embeds_images``: CLIP, SigLIP.
        ``tokenizer`` is None under ``skip_tokenizer_init=True``. ``reasoning_parser`` (a
        :mod:`dfllm.reasoning` parser, or its name: ``ValueError`` now for an unknown one or a
        tokenizer without its markers) is given to every request, for the template variables
        it was rendered with."""
        self.tokenizer = tokenizer
        self._last_copy: SamplingParams | None = None  # the newest request's params copy (_shared)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_logprobs = max_logprobs
        self.structured_defaults = structured_defaults
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self.reasoning = (
            make_reasoning_parser(reasoning_parser, tokenizer)
            if isinstance(reasoning_parser, str)
            else reasoning_parser
        )
        self.mm = mm  # a vision-language model's images (None: text only)
        self.embeds_images, self.model_name = embeds_images, model_name

    # ---- text to tokens --------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of ``texts`` (with the tokenizer's special tokens, as ``generate`` does)."""
        if not texts:
            return []
        tokenizer = self._tokenizer(
            "You cannot pass text prompts when `skip_tokenizer_init` is True (this engine "
            "has no tokenizer; give token ids)",
            "prompt",
        )
        return tokenizer(list(texts))["input_ids"]

    def render_chat(
        self,
        conversation: list[dict],
        chat_template: str | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> TokenizedPrompt:
        """One conversation rendered with the tokenizer's chat template (or ``chat_template``)
        in transformers' sandboxed Jinja environment, and tokenized. A template variable nested
        more than :data:`~dfllm.errors.MAX_NESTING_DEPTH` levels deep is refused by name (the
        template walks it)."""
        if isinstance(chat_template_kwargs, dict):
            with invalid_request():
                check_nesting(chat_template_kwargs, "chat_template_kwargs", "variable")
        tokenizer = self._tokenizer(
            f"{NO_TOKENIZER} (chat renders conversations with the tokenizer's chat "
            "template; without one, give token ids to generate)",
            "messages",
        )
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("the tokenizer has no chat template; pass chat_template=...")
        # tokenize=False: the rendered text (transformers annotates every return type at once)
        if self.mm is not None:  # image parts: placeholders as the template takes them (dfllm.multimodal)
            template = chat_template or getattr(tokenizer, "chat_template", None)
            messages = [self.mm.flatten_content(m, template) for m in conversation]
        elif has_image_parts(conversation):
            raise InvalidRequestError(
                "image parts: this model takes no images (it is a text-only model: content "
                "must be a str or a list of text parts)",
                parameter="messages",
            )
        else:
            messages = [_flatten_content(m) for m in conversation]
        text = cast(
            str,
            tokenizer.apply_chat_template(
                messages,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            ),
        )
        return TokenizedPrompt(
            text,
            tokenizer.encode(text, add_special_tokens=False),
            dict(chat_template_kwargs) if chat_template_kwargs else None,
            chat=True,
        )

    @cached_property
    def _max_chars_per_token(self) -> int | None:
        """The longest token of the vocabulary, in characters (vLLM's ``max_chars_per_token``:
        a text longer than ``max_model_len`` times this is refused before tokenizing)."""
        if self.tokenizer is None:
            return None
        return max((len(token) for token in self.tokenizer.get_vocab()), default=None)

    def _tokenizer(self, message: str, parameter: str) -> PreTrainedTokenizerBase:
        """The tokenizer; :class:`~dfllm.errors.InvalidRequestError` with ``message`` without one."""
        if self.tokenizer is None:
            raise InvalidRequestError(message, parameter=parameter)
        return self.tokenizer

    # ---- checked requests ------------------------------------------------------------
    def process(
        self,
        prompt: TokenizedPrompt | dict | str,
        params: SamplingParams,
        what: str = "prompt",
        images: list | None = None,
    ) -> EngineRequest:
        """``prompt`` with ``params`` as a checked request; :class:`~dfllm.errors.InvalidRequestError`
        (a ``ValueError``) naming ``what`` if either is refused. A vision-language model's images
        come from the prompt's ``multi_modal_data`` or, for a chat, ``images`` (its image parts)."""
        with invalid_request():
            if not isinstance(params, SamplingParams):
                raise InvalidRequestError(
                    f"{what}: sampling params must be a SamplingParams, got {type(params).__name__}",
                    parameter="sampling_params",
                )
            tokenized = self._tokenized(prompt, what)
            tokenized, mm_inputs = self._with_images(prompt, tokenized, images, params, what)
            keep = truncation_size(params.truncate_prompt_tokens, self.max_model_len)
            if keep is not None:  # the last tokens, as vLLM truncates
                tokenized = TokenizedPrompt(tokenized.prompt, tokenized.token_ids[-keep:])
            # vLLM checks a text prompt's (or a rendered chat's) length in characters first, and
            # tokenizes it no further than one token past the limit; not once truncated
            text = tokenized.prompt if keep is None and _from_text(prompt) else None
            check_prompt_length(
                len(tokenized.token_ids),
                what,
                self.max_model_len,
                text=text,
                max_chars_per_token=self._max_chars_per_token if text is not None else None,
            )
            check_params_for_model(params, what, self.vocab_size, self.max_logprobs)
            params.check_supported(what)
            if self.tokenizer is None:
                params = self._shared(self._without_tokenizer(params, what))
            grammar = None
            if params.structured_outputs is not None:
                constraint = with_engine_defaults(params.structured_outputs, *self.structured_defaults)
                if constraint is not params.structured_outputs:
                    params = replace(params, structured_outputs=constraint)
                grammar = self.grammars.prepare(constraint)
            return EngineRequest(
                tokenized.prompt,
                tokenized.token_ids,
                params,
                grammar,
                self._bad_words_ids(params),
                self._reasoning(prompt),
                mm_inputs=mm_inputs,
            )

    def _with_images(
        self, prompt, tokenized: TokenizedPrompt, images: list | None, params: SamplingParams, what: str
    ) -> tuple[TokenizedPrompt, MultiModalInputs | None]:
        """The prompt with its images' placeholder tokens expanded, and its images (see
        :class:`~dfllm.multimodal.processor.ImageInputProcessor`); a text-only model refuses images."""
        has_data = isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None
        if self.mm is None:
            if has_data or images:
                raise InvalidRequestError(
                    f"{what}: multi_modal_data: this model takes no images (it is a text-only model)",
                    parameter="multi_modal_data",
                )
            return tokenized, None
        found, kwargs = self.mm.images_of_prompt(prompt, what)
        images = list(images or []) + found
        if images and params.truncate_prompt_tokens is not None:
            raise InvalidRequestError(
                f"{what}: truncate_prompt_tokens cannot be used with images (it could cut an "
                "image's placeholder tokens)",
                parameter="truncate_prompt_tokens",
            )
        ids, mm_inputs = self.mm.process(tokenized.token_ids, images, what, kwargs)
        return TokenizedPrompt(tokenized.prompt, ids, tokenized.chat_template_kwargs), mm_inputs

    def _reasoning(self, prompt) -> ReasoningParser | None:
        """The reasoning parser for ``prompt`` (a rendered chat's template variables decide,
        e.g. Qwen3's ``enable_thinking``); None without one."""
        if self.reasoning is None:
            return None
        kwargs = prompt.chat_template_kwargs if isinstance(prompt, TokenizedPrompt) else None
        return self.reasoning.for_request(kwargs)

    def _shared(self, params: SamplingParams) -> SamplingParams:
        """``params``, or the previous request's copy when equal to it: the copies made per
        request (``_without_tokenizer``'s) are then one object for a run of requests, as the
        caller's own params are, so that the engine's per-step passes read each parameters
        object once in a run of rows sharing it."""
        last = self._last_copy
        if last is not None and last is not params and last == params:
            return last
        self._last_copy = params
        return params

    @staticmethod
    def _without_tokenizer(params: SamplingParams, what: str) -> SamplingParams:
        """``params`` for an engine without a tokenizer (``skip_tokenizer_init=True``): what needs
        one is refused, naming ``what``; the rest runs with ``detokenize=False`` (token ids,
        empty text), as vLLM does."""
        if params.structured_outputs is not None:
            raise InvalidRequestError(
                "Structured outputs requires a tokenizer so it can't be used with "
                f"'skip_tokenizer_init' ({what}: structured_outputs needs the tokenizer)",
                parameter="structured_outputs",
            )
        for field, value in (("stop", params.stop_strings), ("bad_words", params.bad_words)):
            if value:
                raise InvalidRequestError(
                    f"{field} cannot be used with 'skip_tokenizer_init': there is no tokenizer "
                    f"to read the text ({what}: {field}={value!r}; stop_token_ids and "
                    "allowed_token_ids work on token ids)",
                    parameter=field,
                    value=value,
                )
        return replace(params, detokenize=False) if params.detokenize else params

    def process_prompts(self, prompts, sampling_params) -> list[EngineRequest]:
        """``LLM.generate``'s prompts (one or a list) with their params, every one checked
        before any is returned; an error names the prompt by index."""
        with invalid_request():
            items = as_prompt_list(prompts)
            params = _per_prompt(sampling_params, len(items))
            return [self.process(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(zip(items, params))]

    def process_chats(
        self,
        messages,
        sampling_params,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[EngineRequest]:
        """``LLM.chat``'s conversations (one or a list) rendered and checked; errors name the
        conversation by index."""
        with invalid_request():
            if add_generation_prompt and continue_final_message:
                raise InvalidRequestError(
                    f"{CHAT_FLAGS_CONFLICT} (add_generation_prompt and continue_final_message cannot both be True)"
                )
            convs = as_conversation_list(messages)
            params = _per_prompt(sampling_params, len(convs))
            images = [self._chat_images(c, f"conversation {i}") for i, c in enumerate(convs)]
            rendered = [
                self.render_chat(
                    c,
                    chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template_kwargs=chat_template_kwargs,
                )
                for c in convs
            ]
            return [
                self.process(p, sp, f"prompt {i}", ims) for i, (p, sp, ims) in enumerate(zip(rendered, params, images))
            ]

    def _chat_images(self, conversation: list[dict], what: str) -> list:
        """The images of a conversation's image parts; refused by a text-only model."""
        if self.mm is None:
            if has_image_parts(conversation):
                raise InvalidRequestError(
                    f"{what}: image parts: this model takes no images (it is a text-only "
                    "model: content must be a str or a list of text parts)",
                    parameter="messages",
                )
            return []
        return self.mm.images_of_conversation(conversation, what)

    # ---- pooling requests ------------------------------------------------------------
    def process_pooling(
        self, prompts, pooling_params, truncate_prompt_tokens: int | None = None, task: str | None = None
    ) -> list[PoolingRequest]:
        """A pooling call's prompts (one or a list) with their params, each checked, tokenized
        and truncated (to ``max_model_len`` and ``truncate_prompt_tokens``) before any is
        returned; an error names the prompt by index. ``task``: the call's, which params
        naming another task are refused for."""
        with invalid_request():
            items = as_prompt_list(prompts)
            params = _per_prompt(pooling_params, len(items), PoolingParams, "pooling_params")
            ids: list[list[int] | ImagePrompt | None] = [None] * len(items)
            texts: dict[int, list[int]] = {}
            for i, (item, p) in enumerate(zip(items, params)):
                limit = self._pooling_limit(p, truncate_prompt_tokens)
                if isinstance(item, dict) and item.get("multi_modal_data") is not None:
                    ids[i] = self._image_prompt(item, i)
                elif isinstance(item, dict) and "prompt_token_ids" in item:
                    ids[i] = check_token_ids(item["prompt_token_ids"], f"prompt {i}", self.vocab_size)[:limit]
                else:
                    text = item.get("prompt") if isinstance(item, dict) else item
                    if not isinstance(text, str):
                        raise not_a_prompt(item, f"prompt {i}")
                    check_unicode(text, f"prompt {i}")
                    texts.setdefault(limit, []).append(i)
            if texts:
                tokenizer = self._tokenizer(
                    "You cannot pass text prompts when `skip_tokenizer_init` is True (prompt "
                    f"{min(min(idx) for idx in texts.values())}: this LLM has no tokenizer; "
                    'give {"prompt_token_ids": [...]})',
                    "prompt",
                )
                for limit, idx in texts.items():
                    enc = tokenizer(
                        [items[i]["prompt"] if isinstance(items[i], dict) else items[i] for i in idx],
                        truncation=True,
                        max_length=limit,
                    )["input_ids"]
                    for i, e in zip(idx, enc):
                        ids[i] = e
            for i, e in enumerate(ids):
                if not isinstance(e, ImagePrompt):
                    check_prompt_length(len(e or []), f"prompt {i}", None)  # truncated: only emptiness is refused
            for i, p in enumerate(params):
                if task is not None and p.task is not None and p.task != task:
                    # vLLM 0.32's words (vllm/entrypoints/pooling/base/io_processor.py), then dfllm's
                    raise InvalidRequestError(
                        f"You cannot overwrite param.task={p.task!r} with pooling_task={task!r}! "
                        f"(pooling_params of prompt {i}: task={p.task!r} is not this call's {task!r})",
                        parameter="task",
                        value=p.task,
                    )
            return [
                PoolingRequest([], p, image=e) if isinstance(e, ImagePrompt) else PoolingRequest(e or [], p)
                for e, p in zip(ids, params)
            ]

    def process_pairs(
        self, left: list[str], right: list[str], params: PoolingParams, truncate_prompt_tokens: int | None, joined: bool
    ) -> list[PoolingRequest]:
        """A cross-encoder's text pairs (checked by :func:`score_pairs`) tokenized together and
        truncated as :meth:`process_pooling` truncates; ``joined`` (an LLM as reranker): the two
        texts concatenated with no separator, as vLLM tokenizes them.

        The pairs are tokenized in one batch, with vLLM's tokens: vLLM tokenizes each pair
        alone, ``tokenizer(text=a, text_pair=b)``, where an empty ``b`` is no pair at all
        (``("a", "")`` is ``[CLS] a [SEP]``, not ``[CLS] a [SEP] [SEP]``), so those pairs are
        tokenized as their first text alone."""
        limit = self._pooling_limit(params, truncate_prompt_tokens)
        tokenizer = self._tokenizer(f"{NO_TOKENIZER} (score reads texts)", "prompt")
        if joined:
            enc = tokenizer([a + b for a, b in zip(left, right)], truncation=True, max_length=limit)
            joined_types = enc.get("token_type_ids") or [None] * len(left)
            return [PoolingRequest(i, params, t) for i, t in zip(enc["input_ids"], joined_types)]
        ids: list[list[int]] = [[] for _ in left]
        types: list[list[int] | None] = [None] * len(left)
        alone = [k for k, b in enumerate(right) if not b]
        paired = [k for k, b in enumerate(right) if b] if alone else list(range(len(left)))
        for idx, pairs in ((paired, True), (alone, False)):
            if not idx:
                continue
            enc = (
                tokenizer([left[k] for k in idx], [right[k] for k in idx], truncation=True, max_length=limit)
                if pairs
                else tokenizer([left[k] for k in idx], truncation=True, max_length=limit)
            )
            for k, e, t in zip(idx, enc["input_ids"], enc.get("token_type_ids") or [None] * len(idx)):
                ids[k], types[k] = e, t
        return [PoolingRequest(i, params, t) for i, t in zip(ids, types)]

    def _pooling_limit(self, params: PoolingParams, truncate_prompt_tokens: int | None) -> int:
        """How many tokens a pooling prompt keeps: ``max_model_len``, or fewer when asked (more
        is refused: :func:`truncation_size`)."""
        limit = self.max_model_len
        for t in (truncate_prompt_tokens, params.truncate_prompt_tokens):
            if t is not None:
                with invalid_request():
                    PoolingParams(truncate_prompt_tokens=t)  # validates
                    limit = min(limit, truncation_size(t, self.max_model_len) or limit)
        return limit

    def _image_prompt(self, item: dict, i: int) -> ImagePrompt:
        """Prompt ``i``, ``{"multi_modal_data": {"image": image}}`` with an empty or absent
        prompt, as the image to embed (decoded now); ``ValueError`` saying what is wrong."""
        from dfllm.multimodal import image_hash, load_image

        if not self.embeds_images:
            raise InvalidRequestError(
                f"prompt {i}: multi_modal_data: {self.model_name} is a text-only "
                "model; image embeddings need an image-text model (CLIP, SigLIP)",
                parameter="multi_modal_data",
            )
        mm = item["multi_modal_data"]
        if not isinstance(mm, dict) or set(mm) != {"image"}:
            raise ValueError(
                f"prompt {i}: multi_modal_data must be {{'image': image}}, got "
                f"{sorted(mm) if isinstance(mm, dict) else type(mm).__name__}"
            )
        image = mm["image"]
        if isinstance(image, (list, tuple)):
            if len(image) != 1:
                raise ValueError(
                    f"prompt {i}: an embedding prompt takes one image, got {len(image)} (at most 1 image per prompt)"
                )
            image = image[0]
        if item.get("prompt") or item.get("prompt_token_ids"):
            raise ValueError(
                f"prompt {i}: embed text or an image, not both (give the image with an empty or "
                "absent prompt, and the text as a prompt of its own)"
            )
        try:
            img = load_image(image)
        except ValueError as exc:  # ImageLoadError: what could not be read, and why
            raise ValueError(f"prompt {i}: multi_modal_data image: {exc}") from exc
        return ImagePrompt(img, image_hash(img))

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
            return TokenizedPrompt(
                prompt.get("prompt"), check_token_ids(prompt["prompt_token_ids"], what, self.vocab_size)
            )
        text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt" in prompt else prompt
        if isinstance(prompt, dict) and not isinstance(text, str) and "prompt" in prompt:
            raise InvalidRequestError(f"{what}: 'prompt' must be a str, got {type(text).__name__}")
        if not isinstance(text, str):
            raise not_a_prompt(prompt, what)
        tokenizer = self._tokenizer(
            "You cannot pass text prompts when `skip_tokenizer_init` is True "
            f'({what}: this engine has no tokenizer; give {{"prompt_token_ids": [...]}})',
            "prompt",
        )
        ids = tokenizer.encode(check_unicode(text, what))
        return TokenizedPrompt(text, check_token_ids(ids, what, self.vocab_size))


# ---- the checks ------------------------------------------------------------------------------
def check_token_ids(ids, what: str, vocab_size: int) -> list[int]:
    """The token ids of a prompt as a list; :class:`~dfllm.errors.InvalidRequestError` naming
    it (``what``, e.g. "prompt 3") if they are not ints or one is outside the vocabulary."""
    if (
        not isinstance(ids, Seq)
        or isinstance(ids, str)
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise InvalidRequestError(f"{what}: prompt_token_ids must be a list of ints", parameter="prompt_token_ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"Token id {bad[0]} is out of vocabulary ({what}: token id {bad[0]} is outside the "
            f"model's vocabulary [0, {vocab_size}))",
            parameter="prompt_token_ids",
            value=bad[0],
        )
    return list(ids)


# vLLM 0.32's words for a refused prompt, each in one place (dfllm's detail follows in parentheses)
EMPTY_PROMPT = "The decoder prompt cannot be empty"
"""An empty prompt (``vllm/v1/engine/input_processor.py``, ``InputProcessor._validate_prompt_len``)."""

CHAT_FLAGS_CONFLICT = (
    "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when "
    "you want the model to continue the final message, and add_generation_prompt when you want to add a "
    "header that will prompt it to start a new assistant message instead."
)
"""``LLM.chat(add_generation_prompt=True, continue_final_message=True)``: transformers'
``apply_chat_template`` words, which vLLM 0.32 raises as its own (``vllm/renderers/hf.py``,
``safe_apply_chat_template``)."""


def no_room_for_output(n: int, max_model_len: int) -> str:
    """A prompt of exactly ``max_model_len`` tokens (``vllm/v1/engine/input_processor.py``,
    ``InputProcessor._validate_prompt_len``)."""
    return (
        f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) is longer "
        f"than the maximum model length of {max_model_len}. Make sure that `max_model_len` is no smaller than "
        "the number of text tokens (prompt + requested output tokens)."
    )


def too_many_tokens(count: int, max_model_len: int) -> str:
    """A prompt past ``max_model_len`` tokens (``vllm/renderers/params.py``,
    ``TokenizeParams._token_len_check``; parameter ``input_tokens``): ``count`` is the tokens
    vLLM counted, "at least" one past the limit, where it stops tokenizing a text."""
    at_least = "at least " if count == max_model_len + 1 else ""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{at_least}{count} input tokens, which exceeds this limit even without any output tokens. Please reduce "
        "the length of the input prompt."
    )


def too_many_characters(chars: int, max_model_len: int, max_chars_per_token: int) -> str:
    """A text longer than ``max_model_len`` tokens of the longest token could hold
    (``vllm/renderers/params.py``, ``TokenizeParams._text_len_check``; parameter ``input_text``)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains {chars} "
        f"characters (more than {max_model_len * max_chars_per_token} characters, which is the upper bound for "
        f"{max_model_len} input tokens). Please reduce the length of the input prompt."
    )


def check_prompt_length(
    n: int,
    what: str,
    max_model_len: int | None,
    *,
    text: str | None = None,
    max_chars_per_token: int | None = None,
) -> None:
    """Refuse an empty prompt and, unless ``max_model_len`` is None, a generation prompt that
    leaves no room for one output token (``n >= max_model_len``), naming ``what``, in vLLM
    0.32's words for each case. ``text``: the text the ``n`` tokens came from (a text prompt
    or a rendered chat; None for token ids), which vLLM refuses first for its length in
    characters (over ``max_model_len * max_chars_per_token``) and tokenizes no further than
    one token past ``max_model_len`` (so it counts "at least" that many)."""
    m = max_model_len
    if m is not None and text is not None and max_chars_per_token and len(text) > m * max_chars_per_token:
        raise InvalidRequestError(
            f"{too_many_characters(len(text), m, max_chars_per_token)} ({what} has {len(text)} characters and "
            f"{n} tokens, longer than max_model_len={m})",
            parameter="input_text",
            value=len(text),
        )
    if n == 0:  # e.g. an empty string without special tokens, or a chat template that rendered nothing
        raise InvalidRequestError(f"{EMPTY_PROMPT} ({what} is empty: no tokens)")
    if m is None or n < m:
        return
    if n == m:  # no room for the one token every request generates
        raise InvalidRequestError(
            f"{no_room_for_output(n, m)} ({what} has {n} tokens: with its first output token, longer than "
            f"max_model_len={m})"
        )
    count = min(n, m + 1) if text is not None else n
    raise InvalidRequestError(
        f"{too_many_tokens(count, m)} ({what} has {n} tokens, longer than max_model_len={m})",
        parameter="input_tokens",
        value=count,
    )


def _from_text(prompt) -> bool:
    """Whether ``prompt``'s tokens come from its text (a str, a ``{"prompt": ...}`` dict, a
    rendered chat), not given as ``prompt_token_ids``."""
    if isinstance(prompt, TokenizedPrompt):
        return prompt.chat
    return isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)


def truncation_size(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many prompt tokens vLLM's ``truncate_prompt_tokens`` keeps (-1: ``max_model_len``;
    None: no truncation); a size above ``max_model_len`` is refused in vLLM's words, not clamped."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len
    if truncate_prompt_tokens > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens={truncate_prompt_tokens} cannot be greater than max_model_len - "
            f"max_output_tokens = {max_model_len}. Please request a smaller truncation size.",
            parameter="truncate_prompt_tokens",
            value=truncate_prompt_tokens,
        )
    return truncate_prompt_tokens


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
            parameter="allowed_token_ids",
            value=allowed,
        )
    for field in ("logit_bias", "stop_token_ids"):
        ids: set[int] = params.all_stop_token_ids if field == "stop_token_ids" else set(params.logit_bias or ())
        bad = sorted({t for t in ids if not 0 <= t < vocab_size})
        if bad:
            raise InvalidRequestError(
                f"token_id(s) {bad} in {field} contain out-of-vocab token ids. Vocabulary size: {vocab_size} "
                f"({what}: token id(s) {bad[:5]} in {field} are outside the model's vocabulary [0, {vocab_size}))",
                parameter=field,
                value=bad,
            )
    limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    for field, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        asked = getattr(params, field, None)
        if asked is None:
            continue
        k = vocab_size if asked == -1 else asked
        if k <= limit:
            continue
        why = (
            f"{field}={asked} exceeds the model's vocabulary of {vocab_size} tokens (use -1 for all of them)"
            if k > vocab_size
            else f"{field}={asked} exceeds max_logprobs={max_logprobs} (raise it with LLM(max_logprobs=...); -1 "
            "allows the whole vocabulary)"
        )
        raise InvalidRequestError(
            f"Requested {kind} logprobs of {k}, which is greater than max allowed: {limit} ({what}: {why})",
            parameter=field,
            value=k,
        )


def not_a_prompt(prompt, what: str) -> InvalidRequestError:
    """The error for ``prompt``, which is neither a str nor a dict with ``prompt`` or
    ``prompt_token_ids`` (``what`` names it): vLLM's words first where vLLM refuses it by its
    type (None, a float...), then dfllm's."""
    detail = f"{what}: expected a str or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}"
    return InvalidRequestError(detail if isinstance(prompt, dict) else f"{PROMPT_TYPE_ERROR} ({detail})")


def score_pairs(data_1, data_2) -> tuple[list[str], list[str]]:
    """``score``'s texts, each checked, broadcast to pairs: 1 to 1, 1 to N, or N to N."""
    with invalid_request():
        left, right = _score_texts(data_1, "data_1"), _score_texts(data_2, "data_2")
        for side, texts in (("data_1", left), ("data_2", right)):
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    raise InvalidRequestError(f"score {side}[{i}] must be a str, got {type(t).__name__}")
                check_unicode(t, f"score {side}[{i}]")
        # vLLM 0.32's words and order (vllm/entrypoints/pooling/scoring/utils.py), then dfllm's
        if len(left) > 1 and len(left) != len(right):
            raise InvalidRequestError(
                f"Input lengths must be either 1:1, 1:N or N:N (score takes 1 to 1, 1 to N or N to N texts; "
                f"got {len(left)} and {len(right)})"
            )
        for side, texts, name in (("data_1", left, "text"), ("data_2", right, "text_pair")):
            if not texts:
                raise InvalidRequestError(
                    f"At least one {name} element must be given (score needs at least one text on each side; "
                    f"{side} is empty)"
                )
        if len(left) == 1 and len(right) > 1:
            left = left * len(right)
        return left, right


def _score_texts(data, side: str) -> list:
    """One side of ``score``: a str as a list of one, any other iterable but bytes and a dict
    as its list (each element checked by the caller); else refused naming ``side``."""
    if isinstance(data, str):
        return [data]
    if isinstance(data, (bytes, dict)) or not isinstance(data, Iterable):
        raise InvalidRequestError(
            f"score {side} must be a str or a list of str, got {type(data).__name__}", parameter=side
        )
    return list(data)


def _per_prompt(params, n: int, cls: type = SamplingParams, name: str = "sampling_params") -> list:
    """One ``cls`` per prompt (see ``dfllm.inputs.per_prompt_params``); anything else (a
    PoolingParams for a SamplingParams, a dict) is refused by ``name``."""
    if params is not None and not isinstance(params, cls | list | tuple):
        raise InvalidRequestError(
            f"{name} must be a {cls.__name__} or a list of them (one per prompt), got {type(params).__name__}",
            parameter=name,
        )
    return per_prompt_params(params, n, cls, name)


def _flatten_content(msg: dict) -> dict:
    """A message whose content is a list of text parts, with the parts joined by newlines."""
    content = msg["content"]
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    return {**msg, "content": content}
