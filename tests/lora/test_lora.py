"""LoRA adapters: random adapters made by PEFT on tiny random Llama and Qwen2 models.

Each adapter's greedy output must equal transformers with PEFT's adapter loaded (and the
merged model's), in batches mixing adapters and base-model rows, through chunked prefill,
preemption and slot swapping, and over two tensor-parallel ranks; bad adapters are refused
by name before any work starts. The segmented kernels are checked against the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from dfllm import LLM, InvalidRequestError, LoRARequest, SamplingParams
from dfllm.engine.scheduler import Scheduler
from dfllm.engine.sequence import Request, Sequence
from dfllm.kernels.lora import lora_apply, lora_metadata, lora_reference
from dfllm.lora.request import LoRARequest as VllmPathLoRARequest
from dfllm.outputs import RequestMetrics

from helpers import make_adapter, random_prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_TOKENS = 6


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], merged: bool = False) -> list[list[int]]:
    """transformers' greedy decoding with PEFT's adapter loaded (or merged into the weights)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
        if merged:
            model = model.merge_and_unload()
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def setups(tmp_path_factory, tiny_llama, tiny_qwen2):
    """Per family: the base, its adapters, prompts, and PEFT's outputs for each adapter (None: base)."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for family, base, extra in (("llama", tiny_llama, {}), ("qwen2", tiny_qwen2, {})):
        adapters = {
            "all": make_adapter(base, root / f"{family}-all", 1, 8, ALL),
            "qv": make_adapter(base, root / f"{family}-qv", 2, 4, ["q_proj", "v_proj"], alpha=8, rslora=True),
            "mlp": make_adapter(base, root / f"{family}-mlp", 3, 8, ["down_proj", "up_proj", "o_proj"], alpha=32),
        }
        # one shared long prompt (two adapters and the base over the same tokens) and short ones
        prompts = random_prompts(3, 4, 12, seed=5) + [random_prompts(1, 40, 40, seed=6)[0]]
        want = {name: peft_greedy(base, path, prompts) for name, path in [(None, None), *adapters.items()]}
        out[family] = dict(base=base, adapters=adapters, prompts=prompts, want=want, **extra)
    return out


def requests_for(setup) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(setup["adapters"].items())}


def run_mixed(llm: LLM, setup, loras: dict[str, LoRARequest]):
    """Every prompt under every adapter and the base model, shuffled into one call; the outputs
    compared with PEFT's."""
    jobs = [(name, i) for i in range(len(setup["prompts"])) for name in [None, *loras]]
    jobs = jobs[1::2] + jobs[::2]  # adapters interleaved, not grouped
    outs = llm.generate(
        [{"prompt_token_ids": setup["prompts"][i]} for _, i in jobs],
        SamplingParams(max_tokens=MAX_TOKENS, **GREEDY),
        lora_request=[None if n is None else loras[n] for n, _ in jobs],
        use_tqdm=False,
    )
    for (name, i), o in zip(jobs, outs):
        assert o.outputs[0].token_ids == setup["want"][name][i], (name, i)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_batch_equals_peft(setups, family):
    setup = setups[family]
    llm = LLM(
        str(setup["base"]), enable_lora=True, max_loras=3, max_lora_rank=8, kv_cache_memory_bytes=1 << 22, device="cpu"
    )
    loras = requests_for(setup)
    run_mixed(llm, setup, loras)
    # the adapters really differ from the base model and from each other on these prompts
    want = setup["want"]
    assert want["all"] != want[None] and want["qv"] != want[None] and want["mlp"] != want["all"]
    # vLLM's engine calls: the CPU cache holds the three adapters; pin, remove
    engine = llm.llm_engine
    assert engine.list_loras() == {1, 2, 3}
    assert engine.pin_lora(1) and engine.remove_lora(3) and engine.list_loras() == {1, 2}
    one = llm.generate(
        {"prompt_token_ids": setup["prompts"][0]},
        SamplingParams(max_tokens=MAX_TOKENS, **GREEDY),
        lora_request=loras["mlp"],
        use_tqdm=False,
    )  # read again after its removal
    assert one[0].outputs[0].token_ids == want["mlp"][0]


def test_merged_model_equals_adapter(setups, tmp_path):
    """The adapter served on the base equals the merged checkpoint served alone (and PEFT's merge)."""
    setup = setups["llama"]
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(setup["base"], dtype=torch.float32), setup["adapters"]["all"]
    ).merge_and_unload()
    merged = tmp_path / "merged"
    model.save_pretrained(merged)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (setup["base"] / name).exists():
            shutil.copy(setup["base"] / name, merged / name)
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    prompts = [{"prompt_token_ids": p} for p in setup["prompts"]]
    got = LLM(str(merged), kv_cache_memory_bytes=1 << 22, device="cpu").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == setup["want"]["all"]
    assert peft_greedy(setup["base"], setup["adapters"]["all"], setup["prompts"], merged=True) == setup["want"]["all"]


def test_chunked_prefill_preemption_and_slot_swaps(setups):
    """One slot for three adapters (the scheduler runs one adapter per step, swapping slots), a
    16-token budget (prompts prefilled in chunks) and a small KV cache (preemptions)."""
    setup = setups["qwen2"]
    cfg = json.loads((setup["base"] / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = cfg["num_hidden_layers"] * 2 * 4 * cfg["num_key_value_heads"] * head_dim * 4  # block_size 4
    llm = LLM(
        str(setup["base"]),
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_lora_rank=8,
        max_num_batched_tokens=16,
        block_size=4,
        kv_cache_memory_bytes=20 * block_bytes,
        max_model_len=64,
        device="cpu",
    )
    loras = requests_for(setup)
    seen: list[int] = []
    original = llm.llm_engine.scheduler.schedule

    def schedule():  # the distinct adapters of every step
        out = original()
        seen.append(len({s.request.lora_request.lora_int_id for s in out.seqs if s.request.lora_request}))
        return out

    llm.llm_engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    run_mixed(llm, setup, loras)
    assert max(seen) == 1
    assert llm.llm_engine.stats().num_preemptions > 0
    assert llm.llm_engine.lora.loads >= 3  # three adapters through the one slot


def test_prefix_cache_and_dedupe_keep_adapters_apart(setups):
    """The same long prompt under two adapters and the base: no shared KV blocks, no merged requests."""
    setup = setups["llama"]
    llm = LLM(str(setup["base"]), enable_lora=True, max_loras=2, kv_cache_memory_bytes=1 << 22, device="cpu")
    loras = requests_for(setup)
    long = {"prompt_token_ids": setup["prompts"][3]}
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    first = llm.generate([long, long], params, lora_request=[loras["all"], None], use_tqdm=False)
    assert first[0].outputs[0].token_ids == setup["want"]["all"][3]
    assert first[1].outputs[0].token_ids == setup["want"][None][3]
    again = llm.generate([long, long], params, lora_request=[loras["qv"], loras["all"]], use_tqdm=False)
    assert again[0].outputs[0].token_ids == setup["want"]["qv"][3]
    assert again[0].num_cached_tokens == 0  # nothing cached for adapter "qv"
    assert again[1].num_cached_tokens > 0  # adapter "all" hits its own blocks


def test_bad_adapters_are_refused_by_name(setups, tmp_path):
    setup = setups["llama"]
    llm = LLM(str(setup["base"]), enable_lora=True, max_lora_rank=4, kv_cache_memory_bytes=1 << 22, device="cpu")
    prompt = {"prompt_token_ids": setup["prompts"][0]}

    def refused(request, *words):
        with pytest.raises(InvalidRequestError) as err:
            llm.generate([prompt, prompt], lora_request=[None, request], use_tqdm=False)
        for w in words:
            assert w in str(err.value), str(err.value)
        assert not llm.llm_engine.has_unfinished_requests()  # nothing of the call was queued

    refused(LoRARequest("nowhere", 9, str(tmp_path / "missing")), "nowhere", "not a directory")
    refused(LoRARequest("big", 1, str(setup["adapters"]["all"])), "big", "rank 8", "max_lora_rank=4")
    no_weights = tmp_path / "no-weights"
    shutil.copytree(setup["adapters"]["qv"], no_weights)
    (no_weights / "adapter_model.safetensors").rename(no_weights / "adapter_model.bin")
    refused(LoRARequest("pickle", 2, str(no_weights)), "adapter_model.safetensors is missing", "pickle")
    other = tmp_path / "other-model"  # a Qwen2 adapter (other sizes) on the Llama model
    shutil.copytree(setups["qwen2"]["adapters"]["qv"], other)
    refused(LoRARequest("qwen", 3, str(other)), "qwen", "do not fit the base model")
    embed = make_adapter(setup["base"], tmp_path / "embed", 4, 4, ["q_proj", "embed_tokens"])
    refused(LoRARequest("embed", 4, str(embed)), "embed_tokens")
    dora = tmp_path / "dora"
    shutil.copytree(setup["adapters"]["qv"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    refused(LoRARequest("dora", 5, str(dora)), "use_dora")
    ok = LoRARequest("qv", 6, str(setup["adapters"]["qv"]))
    llm.generate(prompt, lora_request=ok, use_tqdm=False)
    refused(LoRARequest("clash", 6, str(embed)), "lora_int_id=6 is already used")
    with pytest.raises(InvalidRequestError, match="2 LoRA requests for 1 prompts"):
        llm.generate(prompt, lora_request=[ok, ok], use_tqdm=False)
    plain = LLM(str(setup["base"]), kv_cache_memory_bytes=1 << 22, device="cpu")
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        plain.generate(prompt, lora_request=ok, use_tqdm=False)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(setup["base"]), enable_lora=True, max_loras=2, max_cpu_loras=1, device="cpu")
    assert VllmPathLoRARequest is LoRARequest


@pytest.mark.slow
def test_tensor_parallel_two_ranks(setups):
    setup = setups["llama"]
    llm = LLM(
        str(setup["base"]),
        enable_lora=True,
        max_loras=2,
        tensor_parallel_size=2,
        kv_cache_memory_bytes=1 << 22,
        device="cpu",
    )
    try:
        run_mixed(llm, setup, requests_for(setup))
    finally:
        llm.shutdown()


def _seq(lora: LoRARequest | None, i: int) -> Sequence:
    tokens = [i + 1] * 8
    req = Request(f"r{i}", None, tokens, SamplingParams(max_tokens=4), RequestMetrics(float(i)), lora_request=lora)
    return Sequence(req, 0, list(tokens), 8)


def test_scheduler_admits_at_most_max_loras_adapters():
    loras = [LoRARequest(f"a{i}", i + 1, "/x") for i in range(3)]
    sched = Scheduler(64, 4, max_num_seqs=16, max_num_batched_tokens=256, max_loras=2)
    seqs = [_seq(loras[i % 3] if i % 4 else None, i) for i in range(12)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    ids = {s.request.lora_request.lora_int_id for s in out.seqs if s.request.lora_request}
    assert len(ids) == 2 and any(s.request.lora_request is None for s in out.seqs)
    assert len(out.seqs) == 9  # the third adapter's rows wait; every other row runs


# ---- the segmented kernels ---------------------------------------------------------------
SLOTS = [0, 0, 0, -1, 2, 1, 2, -1, 1, 1, 0, 2, 2, 2]  # three adapters, rows scattered: the batched path
TWO = [0, 0, 0, -1, 2, -1, 2, -1, 2, 2, 0, 2, 2, 2, 2, 2, 2, 2]  # two adapters: per-segment slices and gathers
SORTED = [-1, -1, 0, 0, 0, 1, 2, 2, 2, 2, 3, 3]  # the engine's order (by slot): batched, added back by one gather


def _kernel_case(dtype=torch.float32, device="cpu", slots=SLOTS):
    g = torch.Generator().manual_seed(0)
    t, k, n, r = len(slots), 40, 72, 16
    x = torch.randn(t, k, generator=g).to(dtype)
    a = torch.randn(4, r, k, generator=g).to(dtype)
    b = torch.randn(4, n, r, generator=g).to(dtype)
    a[1, 8:], b[1, :, 8:] = 0, 0  # slot 1 has rank 8
    y = torch.randn(t, n, generator=g).to(dtype)
    meta = lora_metadata(slots, torch.device(device))
    assert meta is not None and meta.batched == (slots is not TWO) and (meta.unpad is not None) == (slots is SORTED)
    want = y.float() + lora_reference(x, a, b, torch.tensor(slots)).float()
    return [v.to(device) for v in (x, a, b, y)], meta, want


@pytest.mark.parametrize("slots", [SLOTS, TWO, SORTED])
@pytest.mark.parametrize("reduce", [None, lambda s: s])
def test_cpu_segments_equal_reference(reduce, slots):
    (x, a, b, y), meta, want = _kernel_case(slots=slots)
    got = lora_apply(x, y.clone(), a, b, meta, [16, 8, 16, 16], reduce=reduce)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert lora_metadata([-1, -1], torch.device("cpu")) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_sgmv_equals_reference(dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter needs TRITON_INTERPRET=1 (conftest sets it without a GPU)")
    (x, a, b, y), meta, want = _kernel_case(dtype, device)
    got = lora_apply(x, y.clone(), a, b, meta, [16, 8, 16, 16], triton=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol * 10)


# ---- dataframes, the Ray-compatible processor and the CLI ---------------------------------------
TEXTS = ["The sky is blue because", "Dask splits frames into", "A haiku about rain:", "One two three four"]


@pytest.fixture(scope="module")
def frame_case(setups, tmp_path_factory):
    """A frame of texts with a per-row adapter column (paths, a name under a root, null, a bad
    one) and PEFT's output for every good row."""
    from transformers import AutoTokenizer

    setup = setups["llama"]
    root = tmp_path_factory.mktemp("adapter-root")
    shutil.copytree(setup["adapters"]["qv"], root / "qv-named")
    tok = AutoTokenizer.from_pretrained(setup["base"])
    ids = [tok(t)["input_ids"] for t in TEXTS]
    adapters = [
        str(setup["adapters"]["all"]),
        None,
        "qv-named",
        str(setup["adapters"]["mlp"]),
        str(setup["adapters"]["all"]),
        "missing-one",
        None,
        str(setup["adapters"]["mlp"]),
    ]
    a = setup["adapters"]
    sources = [a["all"], None, a["qv"], a["mlp"], a["all"], "bad", None, a["mlp"]]
    expected = [
        None if src == "bad" else tok.decode(peft_greedy(setup["base"], src, [ids[i % 4]])[0])
        for i, src in enumerate(sources)
    ]
    df = pd.DataFrame({"q": TEXTS * 2, "adapter": adapters})
    return dict(df=df, root=str(root), expected=expected, base=setup["base"])


def _check_frame(got: pd.DataFrame, case) -> None:
    for i, (want, err) in enumerate(zip(case["expected"], got["llm_error"])):
        if want is None:
            assert "missing-one" in err and "not a directory" in err, err
        else:
            assert err is None or pd.isna(err), (i, err)
            assert got["generated_text"].iloc[i] == want, i


FRAME_KW = dict(
    sampling_params={"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
    kv_cache_memory_bytes=1 << 22,
    device="cpu",
    max_loras=2,
)


@pytest.mark.slow
def test_pandas_per_row_adapters_equal_peft(frame_case):
    got = frame_case["df"].llm.generate(
        "{q}", model=str(frame_case["base"]), lora="adapter", lora_root=frame_case["root"], **FRAME_KW
    )
    _check_frame(got, frame_case)


def test_fsspec_url_adapter_fetched_once(frame_case, setups, monkeypatch, tmp_path):
    import fsspec

    from dfllm.lora import resolve

    monkeypatch.setenv("DFLLM_LORA_CACHE", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    for f in Path(setups["llama"]["adapters"]["all"]).glob("adapter_*"):
        fs.pipe(f"/lora-test/all/{f.name}", f.read_bytes())
    calls = []
    monkeypatch.setattr(resolve, "_fetched", {})
    original = resolve.fetch
    monkeypatch.setattr(resolve, "fetch", lambda url: calls.append(url) or original(url))
    df = pd.DataFrame({"q": TEXTS[:1] * 3, "adapter": ["memory://lora-test/all"] * 3})
    got = df.llm.generate("{q}", model=str(frame_case["base"]), lora="adapter", **FRAME_KW)
    assert list(got["generated_text"]) == [frame_case["expected"][0]] * 3
    assert calls == ["memory://lora-test/all"] and len(resolve._fetched) == 1


@pytest.mark.slow
def test_dask_local_cluster_per_row_adapters(frame_case):
    import dask.dataframe as dd

    from helpers import local_client

    with local_client(workers=1) as client:
        ddf = dd.from_pandas(frame_case["df"], npartitions=2)
        got = ddf.llm.generate(
            "{q}", model=str(frame_case["base"]), lora="adapter", lora_root=frame_case["root"], **FRAME_KW
        ).compute(scheduler=client.get)
    _check_frame(got.sort_index(), frame_case)


def test_processor_per_row_model_with_dynamic_lora_loading_path(frame_case):
    import dfllm

    base = str(frame_case["base"])
    root = Path(frame_case["root"])
    for name, src in (("all", frame_case["df"]["adapter"][0]), ("mlp", frame_case["df"]["adapter"][3])):
        if not (root / name).exists():
            shutil.copytree(src, root / name)
    config = dfllm.vLLMEngineProcessorConfig(
        model_source=base,
        dynamic_lora_loading_path=str(root),
        should_continue_on_error=True,
        engine_kwargs=dict(kv_cache_memory_bytes=1 << 22, device="cpu", max_loras=2),
        apply_chat_template=False,
        tokenize=False,
        detokenize=False,
    )
    models = ["all", base, "qv-named", "mlp", "missing-one"]
    df = pd.DataFrame({"q": TEXTS + TEXTS[:1], "model": models})
    processor = dfllm.build_processor(
        config,
        preprocess=lambda row: dict(
            prompt=row["q"],
            model=row["model"],
            sampling_params=dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        ),
    )
    got = processor(df)
    assert list(got["generated_text"])[:4] == frame_case["expected"][:4]
    assert "missing-one" in got["__inference_error__"].iloc[4]


@pytest.mark.slow
def test_cli_lora_column(frame_case, cli_cluster, tmp_path):
    from dfllm.jobs.cli import main as cli_main

    src = tmp_path / "in.parquet"
    frame_case["df"].to_parquet(src)
    out = tmp_path / "out"
    status = cli_main(
        [
            "run",
            str(src),
            str(out),
            "--prompt",
            "{q}",
            "--model",
            str(frame_case["base"]),
            "--max-tokens",
            str(MAX_TOKENS),
            "--lora-column",
            "adapter",
            "--lora-root",
            frame_case["root"],
            "--max-loras",
            "2",
            "--max-model-len",
            "64",
            "--npartitions",
            "2",
            "--scheduler",
            cli_cluster.address,
        ]
    )
    assert status == 0
    got = pd.read_parquet(out)
    assert list(got["q"]) == list(frame_case["df"]["q"]) and len(got) == len(frame_case["df"])
    for g, w in zip(got["generated_text"], frame_case["expected"]):
        assert pd.isna(g) if w is None else g == w
