"""LoRA adapters on the pooling calls: a tiny random Llama run with ``runner="pooling"``.

Two random PEFT adapters and the base model share one ``embed`` call; every row must equal
the PEFT-merged model (the adapter merged into the weights, saved, and served alone) and
differ from the base. Bad adapters and encoder models refuse ``lora_request`` by name.
A resumed ``write_parquet`` recomputes when an adapter given for every row is rewritten
at the same path (its files' bytes are in each partition's key).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dask.dataframe as dd
import pandas as pd
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import dfllm
from dfllm import LLM, InvalidRequestError, LoRARequest

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TEXTS = [
    "short",
    "a somewhat longer text about dataframes and engines",
    "mid length text here",
    "parquet partitions on object storage",
]


def make_adapter(base: Path, out: Path, seed: int, r: int, targets: list[str]) -> Path:
    """A random (non-zero) PEFT LoRA adapter of ``base``, saved as PEFT saves it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft.save_pretrained(out)
    return out


def merged_model(base: Path, adapter: Path, out: Path) -> Path:
    """``adapter`` merged into ``base``'s weights by PEFT, saved (safetensors) with the tokenizer."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    model.merge_and_unload().save_pretrained(out)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "vocab.json" or f.name == "merges.txt":
            shutil.copy(f, out / f.name)
    return out


def embeddings(llm: LLM, prompts, **kwargs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False, **kwargs)])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("lora-pooling")
    a = make_adapter(tiny_llama, root / "a", 1, 8, ALL)
    b = make_adapter(tiny_llama, root / "b", 2, 4, ["q_proj", "v_proj", "down_proj"])
    return {
        "a": (a, merged_model(tiny_llama, a, root / "a-merged")),
        "b": (b, merged_model(tiny_llama, b, root / "b-merged")),
    }


@pytest.mark.slow
def test_mixed_adapters_in_one_embed_call_equal_merged_models(tiny_llama, adapters):
    a, b = LoRARequest("a", 1, adapters["a"][0]), LoRARequest("b", 2, adapters["b"][0])
    prompts = TEXTS + [{"prompt_token_ids": [7]}]  # a one-token prompt runs as a decode row
    loras = [a, b, None, a, b]
    llm = LLM(tiny_llama, runner="pooling", enable_lora=True, max_loras=2, max_lora_rank=8)
    mixed = embeddings(llm, prompts, lora_request=loras)
    assert llm.pooling_engine.lora.loads == 2  # both adapters in slots, one batch
    base = embeddings(LLM(tiny_llama, runner="pooling"), prompts)
    alone = {name: embeddings(LLM(merged, runner="pooling"), prompts) for name, (_, merged) in adapters.items()}
    for i, lora in enumerate(loras):
        ref = base[i] if lora is None else alone[lora.lora_name][i]
        cos = torch.nn.functional.cosine_similarity(mixed[i], ref, dim=0).item()
        assert cos >= 0.99999 and torch.allclose(mixed[i], ref, atol=1e-5), (i, cos)
        if lora is not None:
            assert not torch.allclose(mixed[i], base[i], atol=1e-3), i
    # one slot for two adapters: batches split so each holds one adapter; same rows
    one_slot = LLM(tiny_llama, runner="pooling", enable_lora=True, max_loras=1, max_lora_rank=8)
    assert torch.allclose(embeddings(one_slot, prompts, lora_request=loras), mixed, atol=1e-5)
    # one adapter for every prompt; encode and score take it too
    assert torch.allclose(embeddings(llm, prompts, lora_request=b), alone["b"], atol=1e-5)
    raw = llm.encode(TEXTS[:2], pooling_task="embed", use_tqdm=False, lora_request=a)
    assert torch.allclose(torch.stack([o.outputs.data for o in raw]), alone["a"][:2], atol=1e-5)
    score = llm.score(TEXTS[0], TEXTS[1:3], use_tqdm=False, lora_request=a)
    ref_scores = (alone["a"][1:3] @ alone["a"][0]).tolist()
    assert [o.outputs.score for o in score] == pytest.approx(ref_scores, abs=1e-5)


@pytest.mark.slow
def test_bad_lora_requests_are_refused_before_work(tiny_llama, adapters, tmp_path):
    llm = LLM(tiny_llama, runner="pooling", enable_lora=True, max_loras=2, max_lora_rank=4)
    a = LoRARequest("too-big", 1, adapters["a"][0])  # rank 8 > max_lora_rank 4
    with pytest.raises(InvalidRequestError, match="too-big") as err:
        llm.embed(TEXTS[:2], use_tqdm=False, lora_request=[None, a])
    assert "prompt 1" in str(err.value) and err.value.parameter == "lora_request"
    missing = LoRARequest("nowhere", 3, str(tmp_path / "nowhere"))
    with pytest.raises(InvalidRequestError, match="nowhere"):
        llm.encode(TEXTS[:1], pooling_task="token_embed", use_tqdm=False, lora_request=missing)
    with pytest.raises(InvalidRequestError, match="2 LoRA requests for 1 prompts"):
        llm.embed(TEXTS[:1], use_tqdm=False, lora_request=[None, None])
    with pytest.raises(InvalidRequestError, match="one LoRARequest"):
        llm.score("a", "b", use_tqdm=False, lora_request=[LoRARequest("b", 2, adapters["b"][0])])
    plain = LLM(tiny_llama, runner="pooling")
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        plain.embed(TEXTS[:1], use_tqdm=False, lora_request=LoRARequest("b", 2, adapters["b"][0]))


def test_encoder_models_refuse_lora_request(adapters):
    llm = LLM("all-minilm-l6-v2")
    with pytest.raises(InvalidRequestError, match="lora_request.*encoder") as err:
        llm.embed(["x"], use_tqdm=False, lora_request=LoRARequest("b", 2, adapters["b"][0]))
    assert err.value.parameter == "lora_request"


@pytest.mark.slow
def test_resume_recomputes_when_the_adapter_is_rewritten(tiny_llama, tmp_path):
    adapter = make_adapter(tiny_llama, tmp_path / "adapter", 1, 4, ["q_proj", "v_proj"])
    df = pd.DataFrame({"id": range(4), "q": ["one", "two", "three", "four"]})

    def write():
        result = dd.from_pandas(df, npartitions=2).llm.generate(
            "{q}",
            model=str(tiny_llama),
            lora=str(adapter),
            max_model_len=64,
            kv_cache_memory_bytes=2**22,
            sampling_params={"max_tokens": 2, "temperature": 0.0, "ignore_eos": True},
        )
        return dfllm.write_parquet(result, str(tmp_path / "out"), resume=True, progress=False)

    first = write()
    assert (first.written, first.skipped) == (2, 0)
    again = write()  # nothing changed: both partitions kept
    assert (again.written, again.skipped) == (0, 2)
    make_adapter(tiny_llama, tmp_path / "adapter", 2, 4, ["q_proj", "v_proj"])  # same path and shapes, new weights
    changed = write()
    assert (changed.written, changed.skipped) == (2, 0)
    back = pd.read_parquet(tmp_path / "out")
    assert sorted(back["id"]) == list(range(4)) and back["llm_error"].isna().all()
