"""Turning what a caller gives into requests the engine can run: the one place inputs are checked.

A prompt (text, ``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``, or a conversation
rendered with the chat template) becomes an :class:`EngineRequest`: token ids checked
against the vocabulary and ``max_model_len``, sampling params checked against the model,
and a structured-output constraint compiled. Whoever adds requests to the engine
(``LLM.generate``/``chat``/``enqueue``, the dataframe accessors' driver) builds them here,
so a bad input raises ``ValueError`` naming it before the engine sees it, and
:meth:`~dfllm.engine.llm_engine.LLMEngine.add_request` checks nothing again.

Not thread-safe (transformers' fast tokenizers are not): callers sharing an engine
across threads serialise calls with their own lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from transformers import PreTrainedTokenizerBase

from dfllm.engine.structured import Grammar, GrammarCompiler
from dfllm.inputs import (
    TokenizedPrompt,
    as_conversation_list,
    as_prompt_list,
    check_params_for_model,
    check_token_ids,
    check_unicode,
    per_prompt_params,
)
from dfllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """A checked prompt and its sampling params, ready for ``LLMEngine.add_request``."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: Grammar | None = None  # the compiled structured-output constraint, if any
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences


class InputProcessor:
    """Tokenizes, renders chat templates and checks prompts for one engine's model."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_model_len: int,
                 eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request

    # ---- text to tokens --------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of ``texts`` (with the tokenizer's special tokens, as ``generate`` does)."""
        return self.tokenizer(list(texts))["input_ids"] if texts else []

    def render_chat(self, conversation: list[dict], chat_template: str | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> TokenizedPrompt:
        """One conversation rendered with the tokenizer's chat template (or ``chat_template``)
        in transformers' sandboxed Jinja environment, and tokenized."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template=...")
        # tokenize=False: the rendered text (transformers annotates every return type at once)
        text = cast(str, self.tokenizer.apply_chat_template(
            [_flatten_content(m) for m in conversation], chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **(chat_template_kwargs or {})))
        return TokenizedPrompt(text, self.tokenizer.encode(text, add_special_tokens=False))

    # ---- checked requests ------------------------------------------------------------
    def process(self, prompt: TokenizedPrompt | dict | str, params: SamplingParams,
                what: str = "prompt") -> EngineRequest:
        """``prompt`` with ``params`` as a checked request; ``ValueError`` naming ``what``."""
        tokenized = self._tokenized(prompt, what)
        keep = params.truncate_prompt_tokens
        if keep is not None:  # the last tokens, as vLLM truncates (-1: as many as max_model_len)
            keep = self.max_model_len if keep == -1 else keep
            tokenized = TokenizedPrompt(tokenized.prompt, tokenized.token_ids[-keep:])
        n = len(tokenized.token_ids)
        if n == 0:  # e.g. a chat template that rendered nothing
            raise ValueError(f"{what} is empty (no tokens)")
        if n > self.max_model_len:
            raise ValueError(f"{what} has {n} tokens, longer than max_model_len={self.max_model_len}")
        check_params_for_model(params, what, self.vocab_size)
        grammar = None if params.structured_outputs is None else self.grammars.prepare(params.structured_outputs)
        return EngineRequest(tokenized.prompt, tokenized.token_ids, params, grammar, self._bad_words_ids(params))

    def process_prompts(self, prompts, sampling_params) -> list[EngineRequest]:
        """``LLM.generate``'s prompts (one or a list) with their params, every one checked
        before any is returned; an error names the prompt by index."""
        items = as_prompt_list(prompts)
        params = per_prompt_params(sampling_params, len(items))
        return [self.process(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(zip(items, params))]

    def process_chats(self, messages, sampling_params, chat_template: str | None = None,
                      add_generation_prompt: bool = True, continue_final_message: bool = False,
                      chat_template_kwargs: dict | None = None) -> list[EngineRequest]:
        """``LLM.chat``'s conversations (one or a list) rendered and checked; errors name the
        conversation by index."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
        convs = as_conversation_list(messages)
        params = per_prompt_params(sampling_params, len(convs))
        rendered = [self.render_chat(c, chat_template, add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message,
                                     chat_template_kwargs=chat_template_kwargs) for c in convs]
        return [self.process(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(zip(rendered, params))]

    def _bad_words_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens at the start of a text and, when that tokenizes differently
        into as many tokens, after a space (vLLM's rule)."""
        out: list[tuple[int, ...]] = []
        for word in params.bad_words or []:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
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
            raise ValueError(f"{what}: 'prompt' must be a str, got {type(text).__name__}")
        if not isinstance(text, str):
            raise ValueError(f"{what}: expected a str or a dict with 'prompt' or 'prompt_token_ids', "
                             f"got {type(prompt).__name__}")
        ids = self.tokenizer.encode(check_unicode(text, what))
        return TokenizedPrompt(text, check_token_ids(ids, what, self.vocab_size))


def _flatten_content(msg: dict) -> dict:
    """A message whose content is a list of text parts, with the parts joined by newlines."""
    content = msg["content"]
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    return {**msg, "content": content}
