import dataclasses
import json

import numpy as np
import pytest

from pegaflow.bench.harness.traces import Trace, TraceSpec, generate, split_by_instance

SMALL = TraceSpec(
    seed=3,
    num_requests=200,
    num_system_prompts=4,
    system_prompt_tokens=300,
    concurrent_sessions=5,
    turns_min=2,
    turns_max=4,
    user_turn_tokens=40,
    assistant_turn_tokens=20,
    one_off_share=0.2,
    one_off_tokens=100,
    max_tokens=4,
    max_prompt_tokens=1000,
)


def test_same_spec_same_trace_and_seed_changes_it():
    a, b = generate(SMALL), generate(SMALL)
    assert a.fingerprint() == b.fingerprint()
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, b, strict=True))
    c = generate(dataclasses.replace(SMALL, seed=4))
    assert c.fingerprint() != a.fingerprint()


def test_turn_extends_previous_turn_by_assistant_reply_and_user_message():
    trace = generate(SMALL)
    by_index = {r.index: r for r in trace}
    followups = [r for r in trace if r.depends_on is not None]
    assert followups, "the spec must produce multi-turn sessions"
    for r in followups:
        prev = by_index[r.depends_on]
        assert prev.index < r.index
        assert prev.session == r.session and prev.turn + 1 == r.turn
        assert np.array_equal(r.prompt[: len(prev.prompt)], prev.prompt)
        assert len(r.prompt) - len(prev.prompt) == SMALL.assistant_turn_tokens + SMALL.user_turn_tokens


def test_sessions_start_with_their_shared_system_prompt_and_one_offs_share_nothing():
    trace = generate(SMALL)
    n = SMALL.system_prompt_tokens
    firsts = {}
    for r in trace:
        if r.kind == "session":
            firsts.setdefault(r.system_prompt, r.prompt[:n])
            assert np.array_equal(r.prompt[:n], firsts[r.system_prompt])
    assert len(firsts) > 1, "several system prompts must be in use"
    one_offs = [r for r in trace if r.kind == "one_off"]
    assert one_offs and all(r.depends_on is None and r.session == -1 for r in one_offs)
    heads = {tuple(r.prompt[:16]) for r in one_offs}
    assert len(heads) == len(one_offs)
    assert not heads & {tuple(p[:16]) for p in firsts.values()}


def test_token_ids_stay_in_the_vocabulary_and_skip_special_ids():
    trace = generate(SMALL)
    allp = np.concatenate([r.prompt for r in trace])
    assert allp.min() >= SMALL.first_token_id and allp.max() < SMALL.vocab_size
    assert max(len(r.prompt) for r in trace) <= SMALL.longest_session_prompt()


def test_routes_split_the_trace_and_every_instance_sees_every_popular_system_prompt():
    trace = generate(SMALL)
    parts = split_by_instance(trace, 3)
    assert sorted(r.index for p in parts for r in p) == list(range(len(trace)))
    for i, part in enumerate(parts):
        assert all(r.instance(3) == i for r in part)
    hot = {r.system_prompt for r in trace if r.kind == "session"}
    for part in parts:
        assert {r.system_prompt for r in part if r.kind == "session"} >= hot - {max(hot)}


def test_save_load_round_trip_and_tampering_is_detected(tmp_path):
    trace = generate(SMALL)
    path = tmp_path / "t.jsonl"
    trace.save(path)
    loaded = Trace.load(path)
    assert loaded.fingerprint() == trace.fingerprint() and loaded.spec == trace.spec
    lines = path.read_text().splitlines()
    record = json.loads(lines[5])
    record["prompt"][0] += 1
    lines[5] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="fingerprint"):
        Trace.load(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"turns_min": 5, "turns_max": 4}, "turns_min"),
        ({"num_requests": 0}, "num_requests"),
        ({"one_off_share": 1.5}, "one_off_share"),
        ({"max_prompt_tokens": 200}, "max_prompt_tokens"),
        ({"first_token_id": 5000}, "first_token_id"),
        ({"system_zipf": -1.0}, "system_zipf"),
    ],
)
def test_invalid_specs_are_refused_with_the_field_named(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL, **change)


def test_unknown_spec_fields_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        TraceSpec.from_dict({**SMALL.to_dict(), "typo": 1})
