"""Sampling: each processor on a case computed by hand, per-row parameters in one batch, seeds, stop strings."""
from __future__ import annotations

import math

import pytest
import torch

from runtime.sampling import (RequestSampler, SamplingParams, StopMatcher, apply_min_p, apply_presence_frequency,
                              apply_repetition_penalty, apply_top_k, apply_top_p, process_logits, sample_batch)

INF = float("inf")


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def _kept(logits: torch.Tensor) -> list[bool]:
    return torch.isfinite(logits[0]).tolist()


def test_top_k_keeps_the_k_largest_and_zero_means_off():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    out = apply_top_k(logits, torch.tensor([[2], [0]]))
    assert out[0].tolist() == [-INF, 4.0, 3.0, -INF]
    assert out[1].tolist() == logits[1].tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = _logits_of([0.5, 0.3, 0.15, 0.05])
    # mass before each token: 0, .5, .8, .95 -> p=.8 keeps the first two, p=.81 the first three
    assert _kept(apply_top_p(logits, torch.tensor([[0.8]]))) == [True, True, False, False]
    assert _kept(apply_top_p(logits, torch.tensor([[0.81]]))) == [True, True, True, False]
    assert _kept(apply_top_p(logits, torch.tensor([[0.3]]))) == [True, False, False, False]
    assert _kept(apply_top_p(logits, torch.tensor([[1.0]]))) == [True, True, True, True]
    shuffled = _logits_of([0.15, 0.05, 0.5, 0.3])   # order in the vocabulary does not matter
    assert _kept(apply_top_p(shuffled, torch.tensor([[0.8]]))) == [False, False, True, True]


def test_min_p_is_relative_to_the_top_token():
    logits = _logits_of([0.5, 0.3, 0.15, 0.05])
    # threshold = 0.2 * 0.5 = 0.1 -> drops only the 0.05 token; 0.35 * 0.5 = 0.175 drops 0.15 too
    assert _kept(apply_min_p(logits, torch.tensor([[0.2]]))) == [True, True, True, False]
    assert _kept(apply_min_p(logits, torch.tensor([[0.35]]))) == [True, True, False, False]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([[2.0]]))
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.zeros(1, 4)
    counts = torch.tensor([[0, 1, 3, 0]])
    out = apply_presence_frequency(logits, counts, torch.tensor([[0.5]]), torch.tensor([[0.25]]))
    assert out.tolist() == [[0.0, -0.75, -1.25, 0.0]]


def test_penalties_use_prompt_for_repetition_and_output_for_presence():
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    sampler = RequestSampler(params, prompt_ids=[0])
    sampler.observe(2)
    sampler.observe(2)
    out = process_logits(torch.tensor([[4.0, 4.0, 4.0, 4.0]]), [sampler])
    # token 0: prompt only -> 4/2; token 2: output twice -> 4/2 - 1 - 0.5*2
    assert out.tolist() == [[2.0, 4.0, 0.0, 4.0]]
    sampler.observe(1)                                  # counts follow observe() after the tensors exist
    out = process_logits(torch.tensor([[4.0, 4.0, 4.0, 4.0]]), [sampler])
    assert out.tolist() == [[2.0, 0.5, 0.0, 4.0]]


def test_temperature_scales_and_zero_is_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = process_logits(logits, [RequestSampler(SamplingParams(temperature=0.5))])
    assert out.tolist() == [[2.0, 6.0, 4.0]]
    gen = torch.Generator().manual_seed(0)
    batch = torch.randn(6, 50, generator=gen)
    greedy = [RequestSampler(SamplingParams(temperature=0.0)) for _ in range(6)]
    assert sample_batch(batch, greedy).tolist() == batch.argmax(dim=-1).tolist()
    top1 = [RequestSampler(SamplingParams(temperature=1.5, top_k=1, seed=i)) for i in range(6)]
    assert sample_batch(batch, top1).tolist() == batch.argmax(dim=-1).tolist()


def test_rows_keep_their_own_parameters_in_a_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 32, generator=gen)
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.6),
              SamplingParams(temperature=1.0, min_p=0.3, repetition_penalty=1.5),
              SamplingParams(temperature=0.0)]
    prompts = [[1, 2], [3], [4, 5, 6], []]
    together = process_logits(logits, [RequestSampler(p, prompt_ids=q) for p, q in zip(params, prompts)])
    for row, (p, q) in enumerate(zip(params, prompts)):
        alone = process_logits(logits[row:row + 1], [RequestSampler(p, prompt_ids=q)])
        assert torch.equal(together[row:row + 1], alone)
    assert int(torch.isfinite(together[0]).sum()) == 5


def test_a_seed_reproduces_and_does_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 64, generator=gen)

    def draws(seed, companions=0):
        samplers = [RequestSampler(SamplingParams(temperature=1.0, seed=seed))]
        samplers += [RequestSampler(SamplingParams(temperature=1.0, seed=100 + i)) for i in range(companions)]
        out = []
        for _ in range(30):
            out.append(sample_batch(logits.expand(len(samplers), -1), samplers)[0].item())
        return out

    first = draws(7)
    assert draws(7) == first
    assert draws(7, companions=2) == first
    assert draws(8) != first
    assert RequestSampler(SamplingParams(temperature=1.0, seed=7)).output_ids == []


def test_draws_follow_the_filtered_distribution():
    logits = _logits_of([0.6, 0.2, 0.15, 0.05])
    sampler = RequestSampler(SamplingParams(temperature=1.0, top_k=2, seed=3))
    counts = [0, 0, 0, 0]
    for _ in range(400):
        counts[sample_batch(logits, [sampler], observe=False).item()] += 1
    assert counts[2] == counts[3] == 0
    assert 0.65 < counts[0] / 400 < 0.85          # 0.6 / (0.6 + 0.2) = 0.75 after the filter


def test_sample_batch_records_tokens_for_penalties():
    sampler = RequestSampler(SamplingParams(temperature=0.0, frequency_penalty=10.0))
    logits = torch.tensor([[1.0, 0.5, 0.0]])
    picks = [sample_batch(logits, [sampler]).item() for _ in range(3)]
    assert picks == [0, 1, 2]                       # each pick is penalised away on the next step
    assert sampler.output_ids == [0, 1, 2]


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_tokens=-1), "max_tokens"), (dict(stop=("",)), "stop"),
])
def test_bad_parameters_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_a_single_stop_string_is_not_split_into_characters():
    assert SamplingParams(stop="END").stop == ("END",)


def _stream(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out, stopped = [], False
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            break
    return out, stopped


def test_stop_string_across_token_boundaries():
    out, stopped = _stream(StopMatcher(["</answer>"]), ["The ans", "wer is 4</", "ans", "wer> and more"])
    assert stopped and "".join(out) == "The answer is 4"
    assert out[1] == "wer is 4"                     # "</" is held back: it may begin the stop string
    assert out[2] == ""


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop():
    matcher = StopMatcher(["STOP"])
    out, stopped = _stream(matcher, ["abc ST", "OOP", " x S"])
    assert not stopped
    assert out == ["abc ", "STOOP", " x "]
    assert matcher.flush() == "S"                   # end of generation: the held "S" was never a stop


def test_earliest_of_several_stops_wins_and_later_pushes_are_empty():
    matcher = StopMatcher(["world", "lo w"])
    assert matcher.push("hello world") == ("hel", True)
    assert matcher.matched == "lo w"
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_no_stops_passes_text_through():
    matcher = StopMatcher([])
    assert matcher.push("a</") == ("a</", False)
    assert matcher.flush() == ""


@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_candidate_filtering_equals_filtering_the_whole_vocabulary(shape):
    """The fast paths (top-k candidates, top-p among the most likely 1024, min-p alone) agree with the plain
    whole-vocabulary filters, including rows that mix them and rows that need the full sort."""
    gen = torch.Generator().manual_seed(4)
    vocab = 3000
    logits = torch.randn(6, vocab, generator=gen)
    if shape == "peaked":   # like a language model: a few likely tokens, a long tail
        logits = logits * 4.0
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=50, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=7), SamplingParams(temperature=1.0, min_p=0.05),
              SamplingParams(temperature=1.0, top_p=0.99, min_p=0.01), SamplingParams(temperature=1.0)]
    got = process_logits(logits, [RequestSampler(p) for p in params])
    for row, p in enumerate(params):
        ref = logits[row:row + 1]
        if p.top_k:
            ref = apply_top_k(ref, torch.tensor([[p.top_k]]))
        if p.top_p < 1:
            ref = apply_top_p(ref, torch.tensor([[p.top_p]]))
        if p.min_p:
            ref = apply_min_p(ref, torch.tensor([[p.min_p]]))
        assert torch.equal(torch.isfinite(got[row]), torch.isfinite(ref[0])), (shape, row)
        assert torch.allclose(got[row][torch.isfinite(got[row])], ref[0][torch.isfinite(ref[0])])


def test_top_p_draws_stay_in_the_nucleus():
    logits = _logits_of([0.6, 0.2, 0.15, 0.05])
    sampler = RequestSampler(SamplingParams(temperature=1.0, top_p=0.7, seed=9))
    picks = {sample_batch(logits, [sampler], observe=False).item() for _ in range(200)}
    assert picks == {0, 1}


def test_sparse_penalties_equal_the_whole_vocabulary_formulas_and_leave_the_input_alone():
    gen = torch.Generator().manual_seed(5)
    vocab = 500
    logits = torch.randn(2, vocab, generator=gen) * 3
    before = logits.clone()
    prompt = torch.randint(0, vocab, (300,), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    samplers = [RequestSampler(params, prompt_ids=prompt), RequestSampler(SamplingParams(temperature=1.0))]
    out = process_logits(logits, samplers)                   # builds the sparse state, then more tokens arrive
    for token in [3, 3, 499, 7, 3] + prompt[:5]:
        samplers[0].observe(token)
    out = process_logits(logits, samplers)
    assert torch.equal(logits, before)
    seen = torch.zeros(1, vocab, dtype=torch.bool)
    seen[0, prompt + samplers[0].output_ids] = True
    counts = torch.bincount(torch.tensor(samplers[0].output_ids), minlength=vocab).unsqueeze(0)
    ref = apply_repetition_penalty(logits[:1], seen, torch.tensor([[1.3]]))
    ref = apply_presence_frequency(ref, counts, torch.tensor([[0.4]]), torch.tensor([[0.2]]))
    assert torch.allclose(out[:1], ref)
    assert torch.equal(out[1], logits[1])


def test_the_same_on_the_engine_device(device):
    """On the device the suite runs on (--device cuda on the GPU machine): filters match the whole-vocabulary
    formulas, greedy is the argmax, a seed reproduces, penalties apply."""
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(4, 2000, generator=gen) * 4).to(device)
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1), SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5),
              SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1, seed=3)]
    got = process_logits(logits, [RequestSampler(p, prompt_ids=[1, 2, 3]) for p in params]).cpu()
    ref = apply_top_p(apply_top_k(logits[:1].cpu() / 0.8, torch.tensor([[40]])), torch.tensor([[0.9]]))
    assert torch.equal(torch.isfinite(got[0]), torch.isfinite(ref[0]))
    assert torch.allclose(got[0][torch.isfinite(got[0])], ref[0][torch.isfinite(ref[0])], atol=1e-5)

    def run():
        samplers = [RequestSampler(p, prompt_ids=[1, 2, 3]) for p in params]
        return [sample_batch(logits, samplers).cpu().tolist() for _ in range(10)]

    first = run()
    assert run() == first
    penalised = logits[2].cpu().clone()
    penalised[[1, 2, 3]] = torch.where(penalised[[1, 2, 3]] > 0, penalised[[1, 2, 3]] / 1.2,
                                       penalised[[1, 2, 3]] * 1.2)
    assert first[0][2] == int(penalised.argmax())
