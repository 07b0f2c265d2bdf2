"""Sampling where the logits are: the sampler's results against the per-row host sampler it
replaced, what crosses to the host per step, and (on a GPU) an engine on CUDA against one on CPU."""

from __future__ import annotations

import pytest
import torch

import dfllm.engine.sampler as sampler_mod
from dfllm import LLM, SamplingParams
from dfllm.engine.logit_penalties import apply_penalties, edits_logits
from dfllm.engine.sampler import SampledToken, Sampler, race_noise
from dfllm.engine.sequence import Request, Sequence
from dfllm.engine.structured import GrammarCompiler, apply_masks
from dfllm.outputs import RequestMetrics
from dfllm.structured_outputs import StructuredOutputsParams

VOCAB = 300
EOS = {2}


def seq(
    params: SamplingParams,
    prompt: list[int],
    output: list[int] = (),
    seed: int | None = None,
    bad_words: tuple[tuple[int, ...], ...] = (),
    device: str = "cpu",
) -> Sequence:
    req = Request("r", None, list(prompt), params, RequestMetrics(0.0), bad_words_ids=bad_words)
    gen = None if seed is None else torch.Generator(device).manual_seed(seed)
    return Sequence(req, 0, list(prompt) + list(output), len(prompt), gen)


# ---- the sampler this one replaced (per row, on the host), kept as the reference ---------------
def reference_penalties(logits: torch.Tensor, seqs: list[Sequence], eos: set[int]) -> torch.Tensor:
    for i, s in enumerate(seqs):
        p = s.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if p.allowed_token_ids is not None:
            allowed = logits[i, p.allowed_token_ids].clone()
            logits[i] = float("-inf")
            logits[i, p.allowed_token_ids] = allowed
        for word in s.request.bad_words_ids:
            if len(word) == 1 or (
                s.num_output_tokens >= len(word) - 1 and tuple(s.output_token_ids[-(len(word) - 1) :]) == word[:-1]
            ):
                logits[i, word[-1]] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.token_ids)), dtype=torch.long)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and s.num_output_tokens:
            counts = torch.bincount(torch.tensor(s.output_token_ids), minlength=logits.shape[1])
            counts = counts[: logits.shape[1]].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if s.num_output_tokens < p.min_tokens and s.grammar is None:
            banned = set(p.single_stop_token_ids) | (set() if p.ignore_eos else eos)
            if banned:
                logits[i, sorted(banned)] = float("-inf")
    return logits


def reference_sample(logits: torch.Tensor, seqs: list[Sequence], seed: int) -> list[SampledToken]:
    generator = torch.Generator().manual_seed(seed)
    logits = logits.float().clone()
    raw = {i: torch.log_softmax(logits[i], dim=-1) for i, s in enumerate(seqs) if s.params.logprobs is not None}
    if any(s.grammar is not None for s in seqs):
        apply_masks(logits, [s.grammar for s in seqs])
    logits = reference_penalties(logits, seqs, EOS)
    chosen = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
    if rows:
        params = [seqs[i].params for i in rows]
        x = logits[rows] / torch.tensor([p.temperature for p in params]).unsqueeze(1)
        top_k = [p.top_k if p.top_k > 0 else x.shape[1] for p in params]
        top_p = [p.top_p for p in params]
        if min(top_k) < x.shape[1] or min(top_p) < 1.0:
            srt, order = x.sort(dim=-1, descending=True)
            remove = torch.arange(x.shape[1]).unsqueeze(0) >= torch.tensor(top_k).unsqueeze(1)
            pr = torch.softmax(srt.masked_fill(remove, float("-inf")), dim=-1)
            remove |= pr.cumsum(dim=-1) - pr >= torch.tensor(top_p).unsqueeze(1)
            remove[:, 0] = False
            x = torch.empty_like(x).scatter_(1, order, srt.masked_fill(remove, float("-inf")))
        probs = torch.softmax(x, dim=-1)
        min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
        if bool((min_p > 0).any()):
            probs = torch.where(probs >= min_p * probs.max(dim=-1, keepdim=True).values, probs, 0.0)
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            noise[j].exponential_(generator=seqs[i].generator or generator)
        chosen[rows] = (probs / noise).argmax(dim=-1)
    out = []
    for i, token in enumerate(chosen.tolist()):
        if i not in raw:
            out.append(SampledToken(token))
            continue
        lp, k = raw[i], seqs[i].params.logprobs
        value = float(lp[token])
        k = lp.numel() if k == -1 else k
        top = []
        if k > 0:
            values, ids = lp.topk(k)
            top = [(int(t), float(v), r + 1) for r, (v, t) in enumerate(zip(values, ids))]
        top = [(token, value, int((lp > value).sum()) + 1)] + [e for e in top if e[0] != token]  # vLLM's order
        out.append(SampledToken(token, value, top))
    return out


# ---- a batch with every sampling mode --------------------------------------------------------
def every_mode(device: str = "cpu") -> list[Sequence]:
    P = SamplingParams
    return [
        seq(P(temperature=0.0), [5, 6, 7]),
        seq(P(temperature=0.0, logprobs=3, repetition_penalty=1.3), [5, 9, 9], [11, 5]),
        seq(P(temperature=0.8, seed=3), [1, 2], [4], seed=3, device=device),
        seq(P(temperature=1.2, top_k=20), [3]),
        seq(P(temperature=0.7, top_p=0.6, logprobs=0), [3, 4], [8]),
        seq(P(temperature=1.0, min_p=0.2, seed=9, logprobs=-1), [7], seed=9, device=device),
        seq(
            P(temperature=0.0, logit_bias={17: 40.0, 3: -2.5}, presence_penalty=0.5, frequency_penalty=0.3),
            [17, 3],
            [17, 17, 40],
        ),
        seq(P(temperature=0.0, allowed_token_ids=[10, 11, 12, 250], logprobs=2), [1]),
        seq(P(temperature=0.9, min_tokens=4, stop_token_ids=[99]), [1, 2], [21, 22], bad_words=((21, 22, 23), (44,))),
        seq(P(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=0.8), [6, 7, 8], [6]),
    ]


def test_penalties_equal_the_per_row_reference():
    torch.manual_seed(0)
    logits = torch.randn(10, VOCAB) * 4
    seqs = every_mode()
    expected = reference_penalties(logits.clone(), seqs, EOS)
    got = logits.clone()
    apply_penalties(got, seqs, EOS)
    assert torch.equal(got, expected)
    assert torch.isinf(got[7]).sum() == VOCAB - 4 and torch.isinf(got[8, [23, 44, 2, 99]]).all()


@pytest.mark.parametrize("trial", range(3))
def test_sampler_equals_the_host_sampler_it_replaced(trial):
    torch.manual_seed(trial)
    logits = torch.randn(10, VOCAB) * 3
    got = Sampler(EOS, seed=trial)(logits.clone(), every_mode())
    assert got == reference_sample(logits, every_mode(), seed=trial)
    assert len(got[5].top) >= VOCAB and got[4].top == [(got[4].token_id, got[4].logprob, got[4].top[0][2])]
    sampled = [i for i, s in enumerate(every_mode()) if not s.params.is_greedy]  # no greedy row at all
    got = Sampler(EOS, seed=trial)(logits[sampled].clone(), [every_mode()[i] for i in sampled])
    assert got == reference_sample(logits[sampled], [every_mode()[i] for i in sampled], seed=trial)


@pytest.mark.parametrize("one_launch", [False, True])
def test_a_seeded_row_draws_its_own_noise_whatever_the_batch(one_launch):
    probs = torch.rand(4, VOCAB)
    gens = [None, torch.Generator().manual_seed(5), None, torch.Generator().manual_seed(6)]
    noise = race_noise(probs, gens, torch.Generator().manual_seed(1), one_launch)
    for j, seed in ((1, 5), (3, 6)):
        assert torch.equal(noise[j], torch.empty(VOCAB).exponential_(generator=torch.Generator().manual_seed(seed)))
    engine = torch.Generator().manual_seed(1)
    if one_launch:  # the unseeded rows: one draw over the whole batch
        expected = torch.empty(4, VOCAB).exponential_(generator=engine)[[0, 2]]
    else:  # row by row, in order
        expected = torch.stack([torch.empty(VOCAB).exponential_(generator=engine) for _ in range(2)])
    assert torch.equal(noise[[0, 2]], expected)


# ---- what crosses to the host ----------------------------------------------------------------
_HOST_READS = ("tolist", "item", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """Records every tensor read to the host (outside ``HostCopy.read``, the one place that reads
    the sampler's results) and every ``to_host`` call."""
    calls: dict[str, list] = {"outside": [], "inside": [], "to_host": []}
    depth = [0]
    for name in _HOST_READS:
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls["inside" if depth[0] else "outside"].append((_name, tuple(self.shape)))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    real_to_host = sampler_mod.to_host

    def to_host(token_ids, logprobs, row_max=None, logits=None):
        shapes = [tuple(token_ids.shape)] + ([] if row_max is None else [("max", *row_max.shape)])
        if logprobs is not None:
            shapes += [tuple(logprobs.chosen.shape), tuple(logprobs.ranks.shape)]
            shapes += [tuple(t.shape) for _, values, ids in logprobs.top for t in (values, ids)]
        calls["to_host"].append(shapes)
        return real_to_host(token_ids, logprobs, row_max, logits)

    real_read = sampler_mod.HostCopy.read

    def read(self):
        depth[0] += 1
        try:
            return real_read(self)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(sampler_mod, "to_host", to_host)
    monkeypatch.setattr(sampler_mod.HostCopy, "read", read)
    return calls


@pytest.fixture(scope="module")
def regex_grammar(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    compiler = GrammarCompiler(tok, len(tok), {tok.eos_token_id})
    return compiler.prepare(StructuredOutputsParams(regex="(yes|no)[0-9]{2}")), len(tok)


@pytest.mark.parametrize("mode", range(10))
def test_only_row_sized_results_cross_to_the_host(mode, host_reads):
    torch.manual_seed(mode)
    rows = 4
    seqs = [every_mode()[mode] for _ in range(rows)]
    for i, s in enumerate(seqs):  # each row its own generator where the mode is seeded
        s.generator = None if s.generator is None else torch.Generator().manual_seed(i)
    Sampler(EOS, seed=0)(torch.randn(rows, VOCAB), seqs)
    assert host_reads["outside"] == []
    assert [name for name, _ in host_reads["inside"]] == ["tolist"]  # one transfer
    (shapes,) = host_reads["to_host"]
    k = seqs[0].params.logprobs
    # the tokens, coded by the non-finite check (in the argmax's pass where every row is greedy
    # and unedited, else from each row's maximum)
    plain = seqs[0].params.is_greedy and k is None and not edits_logits(seqs)
    assert shapes[:2] == ([(rows,)] if plain else [(rows,), ("max", rows)])
    expected = [] if k is None else [(rows,), (rows,)] + ([(rows, VOCAB if k == -1 else k)] * 2 if k else [])
    assert shapes[1 if plain else 2 :] == expected


@pytest.mark.slow
def test_constrained_rows_cross_only_their_tokens(regex_grammar, host_reads):
    grammar, vocab = regex_grammar
    seqs = [seq(SamplingParams(temperature=t, logprobs=1), [1, 2]) for t in (0.0, 1.0, 0.5)]
    seqs[0].grammar, seqs[2].grammar = grammar.matcher(), grammar.matcher()
    out = Sampler(EOS, seed=0)(torch.randn(3, vocab), seqs)
    assert host_reads["outside"] == [] and [n for n, _ in host_reads["inside"]] == ["tolist"]
    assert host_reads["to_host"] == [[(3,), ("max", 3), (3,), (3,), (3, 1), (3, 1)]]
    for i in (0, 2):  # the grammar allowed them
        assert seqs[i].grammar.accept(out[i].token_id)


# ---- on a GPU --------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the sampler on a device)")


@cuda
def test_sampler_on_cuda_equals_cpu_for_the_deterministic_modes():
    torch.manual_seed(0)
    logits = torch.randn(10, VOCAB) * 3
    greedy = [i for i, s in enumerate(every_mode()) if s.params.is_greedy]
    on_cpu = Sampler(EOS, 0)(logits.clone(), every_mode())
    on_gpu = Sampler(EOS, 0)(logits.cuda(), every_mode("cuda"))
    for i in greedy:
        assert on_gpu[i].token_id == on_cpu[i].token_id
        if on_cpu[i].logprob is not None:
            assert on_gpu[i].logprob == pytest.approx(on_cpu[i].logprob, abs=1e-5)
            assert [t for t, _, _ in on_gpu[i].top] == [t for t, _, _ in on_cpu[i].top]
    seeded = every_mode("cuda")[2]  # a seeded row's token does not depend on its batch
    alone = Sampler(EOS, 0)(logits[2:3].cuda(), [seeded])[0].token_id
    assert on_gpu[2].token_id == alone
    got = logits.cuda()
    apply_penalties(got, every_mode("cuda"), EOS)
    assert torch.equal(got.cpu(), reference_penalties(logits.clone(), every_mode(), EOS))


@cuda
def test_engine_on_cuda_matches_cpu(tiny_llama):
    prompts = [{"prompt_token_ids": [1 + i, 20 + 3 * i, 7, 300 + i]} for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(tiny_llama, device=device, dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22)
        outs[device] = llm.generate(prompts, greedy, use_tqdm=False)
        if device == "cuda":
            seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
            alone = llm.generate(prompts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
            others = [SamplingParams(temperature=0.9, max_tokens=n, ignore_eos=True) for n in (4, 9, 2)]
            batch = llm.generate(prompts, [seeded] + others, use_tqdm=False)[0].outputs[0].token_ids
            assert alone == batch
    for a, b in zip(outs["cpu"], outs["cuda"]):
        x, y = a.outputs[0], b.outputs[0]
        n = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), len(x.token_ids))
        assert n == len(x.token_ids) or (x.token_ids[n] in y.logprobs[n] and y.token_ids[n] in x.logprobs[n])
        for i in range(n):
            assert y.logprobs[i][y.token_ids[i]].logprob == pytest.approx(
                x.logprobs[i][x.token_ids[i]].logprob, abs=1e-3
            )


def test_unsampleable_rows_are_named_from_their_maximum_and_the_others_unchanged():
    """NaN anywhere, +inf anywhere, or nothing finite: the row gets the message instead of a
    token, and every other row (greedy and seeded alike) gets the token it gets without them."""
    torch.manual_seed(3)
    good = torch.randn(10, VOCAB) * 3
    bad = torch.randn(4, VOCAB)
    bad[0, 7] = float("nan")
    bad[1, 3] = float("inf")
    bad[2] = float("-inf")
    bad[3, 5], bad[3, 9] = float("inf"), float("nan")  # both: NaN wins, as it always did
    modes = every_mode()
    deterministic = [i for i, s in enumerate(modes) if s.params.is_greedy or s.params.seed is not None]
    alone = Sampler(EOS, seed=0)(good.clone(), every_mode())
    mixed_modes = every_mode() + [every_mode()[0] for _ in range(4)]
    got = Sampler(EOS, seed=0)(torch.cat([good, bad]), mixed_modes)
    assert got[10:] == ["NaN", "+inf", "no finite value", "NaN"]
    for i in deterministic:
        assert got[i] == alone[i]
