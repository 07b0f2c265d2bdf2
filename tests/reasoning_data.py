"""A tiny reasoning model: a random Qwen3 made a bigram machine whose greedy decoding writes a
known thinking trace (see tests/llm/test_reasoning.py), with a thinking tokenizer and a
Qwen3-style chat template; shared by the reasoning and the jobs tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

#: Qwen3's template, reduced: with thinking on the prompt ends in "<think>\n" (as Qwen3.5's and
#: DeepSeek-R1's templates do), with enable_thinking=False in "<think>\n\n</think>\n\n".
TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else -%}{{ '<think>\\n' }}{%- endif -%}"
    "{%- endif -%}"
)

ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

REASONING, ANSWER = " wait so", " Paris"

CONV = [{"role": "user", "content": "Capital of France?"}]

SMALL = dict(max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=2**22)


def build_thinker(root: Path, tokenizer_dir: Path) -> Path:
    """The bigram Qwen3 with a thinking tokenizer, saved as a Hugging Face directory."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(ADDED)
    tok.chat_template = TEMPLATE
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    (wait,), (so,), (paris,), (colon,) = ids(" wait"), ids(" so"), ids(" Paris"), ids(":")
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    newline = ids("\n") + ids("\n\n")
    chain = {
        **dict.fromkeys(newline, wait),
        think: wait,
        colon: think,
        wait: so,
        so: end,
        end: paris,
        paris: tok.eos_token_id,
    }
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream carries the token's embedding alone
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for k, (src, dst) in enumerate(chain.items()):
            model.model.embed_tokens.weight[src] = torch.nn.functional.one_hot(torch.tensor(k), 64).float()
            model.lm_head.weight[dst, k] = 2.0
    path = root / "qwen3-thinker"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def ids_of(tok, *parts: str) -> list[int]:
    return [i for p in parts for i in tok.encode(p, add_special_tokens=False)]
