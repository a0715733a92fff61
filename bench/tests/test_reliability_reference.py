"""Reference answers and the token check of the reliability runs (bench/harness/reference.py)."""

import json

import numpy as np
import pytest

from pegaflow.bench.harness import reference, traces
from pegaflow.bench.harness.reference import ReferenceStore, check_answers, prompt_key


def _requests():
    return traces.generate(
        traces.TraceSpec(seed=3, num_requests=12, system_prompt_tokens=64, user_turn_tokens=16,
                         assistant_turn_tokens=8, one_off_tokens=32, max_tokens=4, max_prompt_tokens=512)
    ).requests  # fmt: skip


def test_prompt_key_depends_on_tokens_and_max_tokens_only():
    a = prompt_key([5, 6, 7], 4)
    assert a == prompt_key(np.array([5, 6, 7], dtype=np.int64), 4)
    assert a != prompt_key([5, 6, 8], 4)
    assert a != prompt_key([5, 6, 7], 5)


def test_store_computes_only_missing_prompts_and_reloads(tmp_path):
    reqs = _requests()
    identity = {"model": "m", "vllm": "0.32"}
    path = ReferenceStore.file_for(tmp_path, identity)
    calls = []

    def answer(r):
        calls.append(r.index)
        return [int(r.prompt[0]) % 97] * r.max_tokens

    store = ReferenceStore(path, identity)
    assert store.fill(reqs, answer) == len(reference.distinct_requests(reqs))
    again = ReferenceStore(path, identity)
    assert again.fill(reqs, answer) == 0  # everything cached
    assert len(calls) == len(reference.distinct_requests(reqs))
    assert again.expected(reqs[0]) == [int(reqs[0].prompt[0]) % 97] * reqs[0].max_tokens


def test_store_refuses_answers_of_another_engine(tmp_path):
    path = tmp_path / "ref.json"
    ReferenceStore(path, {"model": "a"}).save()
    with pytest.raises(ValueError, match="another engine"):
        ReferenceStore(path, {"model": "b"})
    path.write_text(json.dumps({"format": "x"}))
    with pytest.raises(ValueError, match="not a"):
        ReferenceStore(path, {"model": "a"})


def test_fill_refuses_an_answer_of_the_wrong_length(tmp_path):
    store = ReferenceStore(tmp_path / "r.json", {"m": 1})
    with pytest.raises(RuntimeError, match="tokens, asked"):
        store.fill(_requests()[:1], lambda r: [1])


def test_check_counts_wrong_tokens_missing_references_and_skips_failures():
    want = {1: [1, 2, 3, 4], 2: [5, 6, 7, 8], 3: [9, 9, 9, 9]}
    records = [
        {"index": 1, "ok": True, "completion_token_ids": [1, 2, 3, 4]},
        {"index": 2, "ok": True, "completion_token_ids": [5, 0, 7]},  # one differs, one missing
        {"index": 3, "ok": False, "completion_token_ids": []},  # a failure: counted elsewhere
        {"index": 4, "ok": True, "completion_token_ids": [1]},  # no reference
    ]
    check = check_answers(records, lambda r: want.get(r["index"]))
    assert (check.checked, check.wrong_requests, check.wrong_tokens, check.unchecked) == (2, 1, 2, 1)
    assert check.examples[0]["index"] == 2 and not check.clean


def test_check_trace_answers_matches_records_by_trace_index(tmp_path):
    reqs = _requests()
    trace = traces.Trace(traces.TraceSpec(max_tokens=4), tuple(reqs))
    store = ReferenceStore(tmp_path / "r.json", {"m": 1})
    store.fill(reqs, lambda r: [7] * r.max_tokens)
    records = [{"index": r.index, "ok": True, "completion_token_ids": [7] * 4} for r in reqs]
    records[3]["completion_token_ids"] = [7, 7, 7, 8]
    check = reference.check_trace_answers(records, trace.requests, store)
    assert (check.checked, check.wrong_requests, check.wrong_tokens) == (len(reqs), 1, 1)


def test_an_answer_vllm_itself_gives_with_some_prefix_cached_is_right_and_nothing_else_is(tmp_path):
    reqs = [r for r in _requests() if len(r.prompt) > 3 * 16]
    identity = {"model": "m"}
    store = ReferenceStore(ReferenceStore.file_for(tmp_path, identity), identity)
    store.fill(reqs, lambda r: [1] * r.max_tokens)
    a, b = reqs[0], reqs[1]
    full, tied, junk = [1] * a.max_tokens, [2] * a.max_tokens, [3] * a.max_tokens
    assert reference.sweep_lengths(a, 16) == list(range(16, (len(a.prompt) - 1) // 16 * 16 + 1, 16))

    def rec(r, got):
        return {"index": r.index, "ok": True, "completion_token_ids": got}

    records = [rec(a, tied), rec(b, junk), rec(a, full)]
    # Before any sweep, both differing prompts are cases; a matching one is not.
    assert [r.index for r in reference.sweep_cases(records, reqs, store, 16)] == [a.index, b.index]
    asked = []

    def vllm(r, k):  # vLLM's own answers: a moves to `tied` with 32 tokens cached; b never moves
        asked.append((r.index, k))
        return tied if (r is a and k == 32) else full

    store.fill_sweep(a, 16, vllm)
    store.fill_sweep(b, 16, vllm)
    assert asked == [(a.index, k) for k in reference.sweep_lengths(a, 16)] + [
        (b.index, k) for k in reference.sweep_lengths(b, 16)
    ]
    again = ReferenceStore(store.path, identity)  # saved with the answers
    assert again.swept(a, 16) and tied in again.alternatives(a)
    assert reference.sweep_cases(records, reqs, again, 16) == []  # b is swept: junk stays wrong
    check = reference.check_trace_answers(records, reqs, again)
    assert (check.checked, check.hit_path_answers, check.wrong_requests) == (3, 1, 1)
    assert [e["index"] for e in check.examples] == [b.index]
