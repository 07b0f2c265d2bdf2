"""The log-probability criterion of :mod:`fidelity` on hand-made outputs: it passes on equal
continuations and on a divergence between near-tied tokens, and fails on everything else."""

from __future__ import annotations

import pytest
from fidelity import GreedyLogprobs, check_logprobs_close


def out(tokens: list[int], tops: list[dict[int, float]] | None = None) -> GreedyLogprobs:
    """A continuation whose top-k at each position is its own token plus two others, unless given."""
    if tops is None:
        tops = [{t: -0.1, t + 1000: -2.5, t + 2000: -3.0} for t in tokens]
    return GreedyLogprobs(tokens, tops)


def check(a: list[GreedyLogprobs], b: list[GreedyLogprobs], **kw) -> None:
    check_logprobs_close(a, b, "dfllm", "transformers", **kw)


def test_equal_outputs_pass():
    check([out([5, 6, 7]), out([]), out([9])], [out([5, 6, 7]), out([]), out([9])])


def test_divergence_between_near_tied_tokens_passes_and_stops_comparison():
    a = out([5, 6, 7, 8, 9], [{5: -0.1}, {6: -0.6, 40: -0.8}, {7: -1.0}, {8: -1.0}, {9: -1.0}])
    b = out([5, 40, 1, 2], [{5: -0.1}, {40: -0.7, 6: -0.7}, {1: -1.0}, {2: -1.0}])
    check([a], [b])  # differing tails and lengths after the divergence are not compared
    check([b], [a])


def test_divergence_outside_the_other_top_k_fails():
    a = out([5, 6, 7], [{5: -0.1}, {6: -0.6, 40: -0.8}, {7: -1.0}])
    b = out([5, 41, 7], [{5: -0.1}, {41: -0.5, 6: -0.9}, {7: -1.0}])
    with pytest.raises(AssertionError, match=r"prompt 0, position 1: transformers's token 41 is not in dfllm's top-2"):
        check([a], [b])


def test_divergence_fails_when_either_side_misses_the_other_token():
    a = out([5, 6], [{5: -0.1}, {6: -0.6, 40: -0.8}])
    b = out([5, 40], [{5: -0.1}, {40: -0.5, 3: -0.9}])  # b's top-k lacks a's token 6
    with pytest.raises(AssertionError, match=r"dfllm's token 6 is not in transformers's top-2"):
        check([a], [b])


def test_failure_names_the_prompt_index_position_and_both_sides():
    good = out([1, 2])
    a = out([3, 4, 5], [{3: -0.1}, {4: -0.1}, {5: -0.1, 6: -3.0}])
    b = out([3, 4, 9], [{3: -0.1}, {4: -0.1}, {9: -0.1, 8: -3.0}])
    with pytest.raises(AssertionError) as err:
        check([good, a], [good, b])
    msg = str(err.value)
    assert "prompt 1, position 2" in msg and "matched tokens: [3, 4]" in msg
    assert "dfllm: token 5" in msg and "transformers: token 9" in msg and "9: -0.1000" in msg


def test_different_lengths_without_divergence_fail():
    with pytest.raises(AssertionError, match="prompt 0: no divergence but dfllm has 2 tokens and transformers 3"):
        check([out([5, 6])], [out([5, 6, 7])])
    with pytest.raises(AssertionError, match="no divergence"):
        check([out([])], [out([5])])


def test_a_shorter_output_may_end_on_eos():
    check([out([5, 2])], [out([5, 2, 7, 8])], eos_token_id=2)
    with pytest.raises(AssertionError, match="does not end with eos 2"):
        check([out([5, 3])], [out([5, 3, 7])], eos_token_id=2)


def test_different_numbers_of_prompts_fail():
    with pytest.raises(AssertionError, match="dfllm has 1 outputs, transformers has 2"):
        check([out([1])], [out([1]), out([2])])


def test_logprobs_missing_for_a_position_fail():
    with pytest.raises(AssertionError, match="prompt 0: dfllm has 2 tokens but 1 logprob positions"):
        check([out([5, 6], [{5: -0.1}])], [out([5, 6])])


def test_divergence_at_the_first_token_is_checked():
    with pytest.raises(AssertionError, match="position 0"):
        check([out([5])], [out([6])])
    check([out([5], [{5: -0.1, 6: -0.2}])], [out([6], [{6: -0.1, 5: -0.2}])])


@pytest.mark.slow
def test_extraction_from_both_sides_on_a_real_model(tmp_path, smollm2_dir, tiny_llama):
    """Both sides report the top-k of the same positions (equal within float noise where the
    prefixes agree), the criterion holds between dfllm and transformers, and it fails against
    another model's greedy outputs."""
    from fidelity import dfllm_greedy_logprobs, hf_greedy_logprobs

    from dfllm import LLM

    from helpers import build_tiny_model

    prompts, n = [[30, 31, 32, 33, 34], [700, 20, 21]], [6, 4]
    ours = dfllm_greedy_logprobs(LLM(tiny_llama, max_model_len=64, kv_cache_memory_bytes=2**22), prompts, n)
    ref = hf_greedy_logprobs(tiny_llama, prompts, n)
    assert [len(o.token_ids) for o in ours] == [len(o.token_ids) for o in ref] == n
    for a, b in zip(ours, ref):
        assert all(len(lp) == 5 for lp in a.logprobs + b.logprobs)
        assert a.token_ids[0] == max(a.logprobs[0], key=a.logprobs[0].__getitem__)
        assert set(a.logprobs[0]) == set(b.logprobs[0])
        for t, v in a.logprobs[0].items():
            assert v == pytest.approx(b.logprobs[0][t], abs=1e-4)
    check_logprobs_close(ours, ref, "dfllm", "transformers")
    other = hf_greedy_logprobs(build_tiny_model(tmp_path, smollm2_dir, seed=7), prompts, n)
    with pytest.raises(AssertionError, match="is not in"):
        check_logprobs_close(ours, other, "dfllm", "other model")
