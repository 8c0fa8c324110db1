"""The invariance report's comparisons (`arcjax.bench.invariance`, `arcjax.bench.step_replay`):
bitwise logprob comparison, the first differing tap, and the probe's workload. The engine
runs themselves are the script's (`scripts/invariance_report.py`): minutes of compiles."""

import numpy as np

from arcjax.bench import invariance
from arcjax.bench.step_replay import HEAD, Taps, TapKey, first_difference


def _run(tokens, logprobs):
    return invariance.ProbeRun(tuple(tokens), np.asarray(logprobs, np.float32), (), None, 0)


def test_compare_counts_differing_bits_not_values():
    base = _run([5, 6, 7], [-1.0, -0.5, -2.0])
    assert invariance.compare(base, _run([5, 6, 7], [-1.0, -0.5, -2.0])).bitwise
    nudged = np.float32(-0.5) + np.float32(2 ** -24)  # one ulp: a different bit pattern
    cmp = invariance.compare(base, _run([5, 6, 7], [-1.0, nudged, -2.0]))
    assert (cmp.tokens_equal, cmp.differing, cmp.first, cmp.bitwise) == (True, 1, 1, False)
    assert 0 < cmp.max_abs < 1e-6
    # -0.0 == 0.0 as numbers, not as bits
    zero = invariance.compare(_run([1], [0.0]), _run([1], [-0.0]))
    assert zero.differing == 1 and not zero.bitwise


def test_compare_reports_a_different_token():
    cmp = invariance.compare(_run([5, 6, 7], [-1.0, -0.5, -2.0]), _run([5, 9], [-1.0, -0.7]))
    assert not cmp.tokens_equal and not cmp.bitwise
    assert (cmp.differing, cmp.first) == (1, 1)


def _taps(entries):
    taps = Taps()
    for pos, key, digest in entries:
        taps.by_position.setdefault(pos, {})[key] = digest
    return taps


def test_first_difference_names_the_earliest_position_then_program_order():
    norm, proj, head = TapKey(0, "qkv", "reduce_sum", 0), TapKey(0, "qkv", "dot_general", 0), \
        TapKey(HEAD, "", "dot_general", 0)
    base = _taps([(3, norm, b"a"), (3, proj, b"b"), (4, norm, b"c"), (4, head, b"d")])
    assert first_difference(base, base) is None
    other = _taps([(3, proj, b"x"), (3, norm, b"a"), (4, norm, b"y"), (4, head, b"z")])
    diff = first_difference(base, other)
    assert (diff.position, diff.key) == (3, proj)
    assert diff.key.describe(num_layers=2) == "layer 0 · qkv · dot_general#0"
    assert head.describe(num_layers=2) == "head · dot_general#0"
    # a key only one run has is skipped; positions only one run has too
    partial = _taps([(4, norm, b"c"), (4, TapKey(1, "mlp", "dot_general", 0), b"q"),
                     (9, norm, b"w")])
    assert first_difference(base, partial) is None


def test_a_later_computation_of_a_position_wins():
    key = TapKey(1, "attention", "pjit", 0)
    taps = _taps([(7, key, b"draft")])
    taps.merge(_taps([(7, key, b"final"), (8, key, b"next")]))
    assert taps.by_position == {7: {key: b"final"}, 8: {key: b"next"}}


def test_probe_prompt_repeats_its_pattern_and_variations_are_distinct():
    work = invariance.Workload(prompt_len=50, pattern=7, seed=3)
    prompt = invariance.probe_prompt(work, vocab=100)
    assert len(prompt) == 50 and prompt[:7] == prompt[7:14] and all(3 <= t < 100 for t in prompt)
    assert prompt != invariance.probe_prompt(invariance.Workload(prompt_len=50, pattern=7), 100)
    names = [v.name for v in invariance.variations()]
    assert len(names) == len(set(names))
    chunks = sorted(dict(v.options)["long_prefill_token_threshold"]
                    for v in invariance.variations() if v.name.startswith("chunk"))
    assert chunks == [16, 64, 256]
    assert sorted(v.prefix_hit for v in invariance.variations() if v.prefix_hit) == [16, 64, 256]


def test_the_recorder_keeps_every_step_of_the_probe_and_restores_the_runner():
    from arcjax.bench.step_replay import StepRecorder
    from arcjax.sampling_params import SamplingParams
    from support.engines import run_to_end, tiny_llm

    llm = tiny_llm(policy="token_budget", chunk_tile=16, max_num_batched_tokens=64)
    runner = llm.engine.runner
    recorder = StepRecorder(runner, "probe")
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.add_request(list(range(3, 23)), params, request_id="probe")
    llm.add_request(list(range(5, 14)), params, request_id="other")
    outs = run_to_end(llm)
    recorder.close()
    assert outs["probe"][-1].outputs[0].finish_reason == "length"
    assert "prepare" not in vars(runner) and "launch" not in vars(runner)
    # the prompt's step and the second token's (the first is sampled at the prompt's end)
    assert len(recorder.steps) == 2
    first, last = recorder.steps
    assert first.batch.positions[first.token_rows].tolist() == list(range(20))
    assert last.batch.positions[last.token_rows].tolist() == [20]
    assert len(first.sample_rows) == 1 and len(last.sample_rows) == 1
