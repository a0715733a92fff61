"""Scheduler-side bookkeeping, driven with vLLM's own Request / SchedulerOutput objects.

The prefix lookup is a set of stored hashes here; the server-backed lookup is covered by
the tests that run pegaflow-server.
"""

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from pegaflow.connector.scheduler import SchedulerConnector

BS = 128
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


class Store:
    """Stored hashes; counts lookups."""

    def __init__(self, hashes=(), available=True):
        self.hashes = set(hashes)
        self.available = available
        self.calls = 0

    def __call__(self, hashes):
        self.calls += 1
        if not self.available:
            return None
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n


def request(rid: str, n_tokens: int, seed: int = 0) -> Request:
    tokens = [(seed * 7919 + i * 31) % 4000 + 3 for i in range(n_tokens)]
    return Request(rid, tokens, SamplingParams(max_tokens=16), None, block_hasher=HASHER)


def blocks(ids) -> KVCacheBlocks:
    return KVCacheBlocks((tuple(KVCacheBlock(block_id=i) for i in ids),))


def step(new=(), cached=(), scheduled=None, preempted=(), resumed=()):
    """new: [(request, block_ids, num_computed)], cached: [(rid, new_block_ids|None, num_computed)]."""
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [
        NewRequestData(
            req_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            mm_features=[],
            sampling_params=r.sampling_params,
            pooling_params=None,
            block_ids=(list(ids),),
            num_computed_tokens=nc,
            lora_request=None,
        )
        for r, ids, nc in new
    ]
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=[c[0] for c in cached],
        resumed_req_ids=set(resumed),
        new_token_ids=[[] for _ in cached],
        all_token_ids={},
        new_block_ids=[(list(c[1]),) if c[1] is not None else None for c in cached],
        num_computed_tokens=[c[2] for c in cached],
        num_output_tokens=[0 for _ in cached],
    )
    out.num_scheduled_tokens = dict(scheduled or {})
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    out.preempted_req_ids = set(preempted)
    return out


def admit(conn, req, block_ids, num_computed=0):
    """What vLLM does when it admits a request: lookup, allocate, tell the connector."""
    ext, is_async = conn.get_num_new_matched_tokens(req, num_computed)
    assert is_async is False
    conn.update_state_after_alloc(req, blocks(block_ids), ext)
    return ext


def test_cold_request_saves_each_full_prompt_block_once():
    store = Store()
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True)
    req = request("a", 1000)
    assert len(req.block_hashes) == 7
    assert admit(conn, req, range(10, 18)) == 0
    meta = conn.build_meta(step(new=[(req, range(10, 18), 0)], scheduled={"a": 1000}))
    assert meta.loads == [] and not meta.failed_loads
    (save,) = meta.saves
    assert save.req_id == "a"
    assert save.block_ids == list(range(10, 17))
    assert save.block_hashes == [bytes(h) for h in req.block_hashes]
    # decode steps: nothing new until block 8 fills (token 1024)
    req.num_computed_tokens = 1000
    for i in range(23):
        req.append_output_token_ids(5)
        meta = conn.build_meta(step(cached=[("a", None, 1000 + i)], scheduled={"a": 1}))
        assert meta.saves == []
    req.append_output_token_ids(5)  # the 1024th token: its block gets a hash
    meta = conn.build_meta(step(cached=[("a", None, 1023)], scheduled={"a": 1}))
    (save,) = meta.saves
    assert save.block_ids == [17] and save.block_hashes == [bytes(req.block_hashes[7])]


def test_hit_loads_the_stored_blocks_beyond_the_local_prefix():
    first = request("x", 1000)
    store = Store(first.block_hashes)
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True)
    req = request("b", 1000)  # same tokens, same hashes
    assert conn.get_num_new_matched_tokens(req, 0) == (896, False)
    assert conn.get_num_new_matched_tokens(req, 0) == (896, False)  # asking again changes nothing
    conn.update_state_after_alloc(req, blocks(range(20, 28)), 896)
    meta = conn.build_meta(step(new=[(req, range(20, 28), 896)], scheduled={"b": 104}))
    (load,) = meta.loads
    assert load.block_ids == list(range(20, 27))
    assert load.block_hashes == [bytes(h) for h in req.block_hashes]
    assert meta.saves == []  # all 7 full blocks are already stored
    assert conn.build_meta(step(cached=[("b", None, 1000)], scheduled={"b": 1})).loads == []


def test_local_prefix_hit_loads_only_the_rest_and_never_the_last_token():
    req = request("c", 1024)  # exactly 8 blocks
    store = Store(req.block_hashes)
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True)
    # vLLM's own cache holds 2 blocks; the store all 8, but the last token must be computed
    assert admit(conn, req, range(8), num_computed=256) == 5 * BS
    meta = conn.build_meta(step(new=[(req, range(8), 896)], scheduled={"c": 128}))
    (load,) = meta.loads
    assert load.block_ids == [2, 3, 4, 5, 6]
    assert load.block_hashes == [bytes(h) for h in req.block_hashes[2:7]]
    assert meta.saves == []  # block 7 (computed now) is stored already


def test_no_lookup_when_the_local_cache_covers_everything():
    req = request("d", 1000)
    store = Store(req.block_hashes)
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True)
    assert admit(conn, req, range(8), num_computed=896) == 0
    assert store.calls == 0
    meta = conn.build_meta(step(new=[(req, range(8), 896)], scheduled={"d": 104}))
    assert meta.loads == [] and meta.saves == []


def test_local_hits_missing_from_the_store_are_saved():
    req = request("e", 1000)
    store = Store(req.block_hashes[:2])  # e.g. the server restarted and lost the rest
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True)
    assert admit(conn, req, range(8), num_computed=512) == 0
    meta = conn.build_meta(step(new=[(req, range(8), 512)], scheduled={"e": 488}))
    (save,) = meta.saves
    assert save.block_ids == [2, 3, 4, 5, 6]


def test_unavailable_store_means_no_hits_and_no_assumptions():
    req = request("f", 1000)
    store = Store(req.block_hashes, available=False)
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True)
    assert admit(conn, req, range(8)) == 0
    meta = conn.build_meta(step(new=[(req, range(8), 0)], scheduled={"f": 1000}))
    assert meta.loads == []
    assert [s.block_ids for s in meta.saves] == [list(range(7))]


def test_chunked_prefill_saves_each_chunk_as_its_blocks_fill():
    req = request("g", 1000)
    conn = SchedulerConnector(block_size=BS, lookup=Store(), loads=True, saves=True)
    admit(conn, req, range(30, 38))
    m1 = conn.build_meta(step(new=[(req, range(30, 34), 0)], scheduled={"g": 500}))
    assert [s.block_ids for s in m1.saves] == [[30, 31, 32]]
    m2 = conn.build_meta(step(cached=[("g", [34, 35, 36, 37], 500)], scheduled={"g": 500}))
    assert [s.block_ids for s in m2.saves] == [[33, 34, 35, 36]]


def test_finished_requests_keep_their_blocks_only_if_they_saved():
    conn = SchedulerConnector(block_size=BS, lookup=Store(), loads=True, saves=True)
    long, short = request("h", 300), request("i", 50)
    admit(conn, long, range(3))
    admit(conn, short, [9])
    conn.build_meta(step(new=[(long, range(3), 0), (short, [9], 0)], scheduled={"h": 300, "i": 50}))
    assert conn.request_finished(long) is True
    assert conn.request_finished(short) is False
    meta = conn.build_meta(step())
    assert meta.delayed_free_req_ids == ["h"]
    assert conn.build_meta(step()).delayed_free_req_ids == []
    assert conn.num_tracked_requests == 0
    # a request that never got blocks
    assert conn.request_finished(request("never", 400)) is False


def test_blocks_computed_in_a_loading_step_are_saved_one_step_later():
    req = request("j", 1000)
    store = Store(req.block_hashes[:3])
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True)
    assert admit(conn, req, range(8)) == 3 * BS
    m1 = conn.build_meta(step(new=[(req, range(8), 384)], scheduled={"j": 616}))
    assert [t.block_ids for t in m1.loads] == [[0, 1, 2]]
    # blocks 3..6 are computed in this step, over the loaded KV: not saved until the
    # workers' load reports are in (under TP one rank's failure corrupts every rank)
    assert m1.saves == []
    m2 = conn.build_meta(step(cached=[("j", None, 1000)], scheduled={"j": 1}))
    assert [s.block_ids for s in m2.saves] == [[3, 4, 5, 6]]


def test_failed_load_rolls_back_and_saves_again_after_the_recompute():
    req = request("j", 1000)
    store = Store(req.block_hashes[:3])
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True)
    assert admit(conn, req, range(8)) == 3 * BS
    m1 = conn.build_meta(step(new=[(req, range(8), 384)], scheduled={"j": 616}))
    assert [t.block_ids for t in m1.loads] == [[0, 1, 2]] and m1.saves == []
    # a worker reported block 1 failed: vLLM truncated the request to block 1 and
    # recomputes from there; blocks 1.. are saved once recomputed, nothing before
    m2 = conn.build_meta(step(cached=[("j", None, 128)], scheduled={"j": 872}))
    assert [s.block_ids for s in m2.saves] == [[1, 2, 3, 4, 5, 6]]


def test_async_scheduling_holds_saves_until_the_loading_step_output_is_seen():
    """With async scheduling step N+1 is built before step N's output (and a roll-back from a
    failed load) is known: saves of a loading request wait one step more."""
    req = request("a", 1000)
    store = Store(req.block_hashes[:3])
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True, steps_in_flight=2)
    assert admit(conn, req, range(8)) == 3 * BS
    m1 = conn.build_meta(step(new=[(req, range(8), 384)], scheduled={"a": 616}))
    assert m1.loads and m1.saves == []
    # step N+1, scheduled while step N runs: vLLM assumes step N computed everything
    m2 = conn.build_meta(step(cached=[("a", None, 1000)], scheduled={"a": 1}))
    assert m2.saves == []
    # step N+2: step N's output was processed, no roll-back: the blocks are saved now
    m3 = conn.build_meta(step(cached=[("a", None, 1001)], scheduled={"a": 1}))
    assert [s.block_ids for s in m3.saves] == [[3, 4, 5, 6]]


def test_async_scheduling_saves_from_the_roll_back_point_after_a_failed_load():
    req = request("b", 1000)
    store = Store(req.block_hashes[:3])
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True, steps_in_flight=2)
    admit(conn, req, range(8))
    conn.build_meta(step(new=[(req, range(8), 384)], scheduled={"b": 616}))
    assert conn.build_meta(step(cached=[("b", None, 1000)], scheduled={"b": 1})).saves == []
    # step N's output reported block 1 failed: vLLM rolled the request back to block 1
    m3 = conn.build_meta(step(cached=[("b", None, 128)], scheduled={"b": 872}))
    assert [s.block_ids for s in m3.saves] == [[1, 2, 3, 4, 5, 6]]


def test_a_waiting_request_asked_about_every_step_is_looked_up_once(monkeypatch):
    from pegaflow.connector import scheduler

    clock = [100.0]
    monkeypatch.setattr(scheduler.time, "monotonic", lambda: clock[0])
    req = request("w", 1000)
    store = Store(req.block_hashes[:3])
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True)
    for _ in range(5):  # vLLM cannot admit it yet (no free blocks) and asks again each step
        assert conn.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
        clock[0] += 0.1
    assert store.calls == 1 and conn.lookups_reused == 4
    clock[0] += scheduler.LOOKUP_REUSE_S  # later, the store may hold more: ask again
    store.hashes = set(req.block_hashes)
    assert conn.get_num_new_matched_tokens(req, 0) == (7 * BS, False)
    assert store.calls == 2
    conn.update_state_after_alloc(req, blocks(range(8)), 7 * BS)
    # a miss (server down: None) is never reused
    req2 = request("x", 1000, seed=1)
    store.available = False
    conn.get_num_new_matched_tokens(req2, 0)
    store.available = True
    conn.get_num_new_matched_tokens(req2, 0)
    assert store.calls == 4


def test_steps_in_flight_must_be_positive():
    with pytest.raises(ValueError):
        SchedulerConnector(block_size=BS, lookup=None, loads=True, saves=True, steps_in_flight=0)


def test_a_request_finishing_in_its_loading_step_still_saves_its_new_blocks():
    req = request("o", 1000)
    store = Store(req.block_hashes[:2])
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True)
    admit(conn, req, range(8))
    m1 = conn.build_meta(step(new=[(req, range(8), 256)], scheduled={"o": 744}))
    assert m1.loads and m1.saves == []
    assert conn.request_finished(req) is True  # vLLM keeps its blocks for the save
    m2 = conn.build_meta(step())
    assert [s.block_ids for s in m2.saves] == [[2, 3, 4, 5, 6]]
    assert m2.delayed_free_req_ids == ["o"]


def test_preempted_and_resumed_requests():
    req = request("k", 600)
    conn = SchedulerConnector(block_size=BS, lookup=Store(), loads=True, saves=True)
    admit(conn, req, range(5))
    conn.build_meta(step(new=[(req, range(5), 0)], scheduled={"k": 600}))
    meta = conn.build_meta(step(preempted={"k"}))
    assert meta.preempted_req_ids == ["k"]
    # resumed: a new lookup (its saved blocks are stored now), new block ids
    store = Store(req.block_hashes)
    conn._lookup = store
    req.num_computed_tokens = 0
    assert admit(conn, req, [40, 41, 42, 43, 44]) == 4 * BS
    meta = conn.build_meta(
        step(cached=[("k", [40, 41, 42, 43, 44], 512)], resumed={"k"}, scheduled={"k": 88})
    )
    assert [t.block_ids for t in meta.loads] == [[40, 41, 42, 43]]
    assert meta.saves == []


def test_roles():
    req = request("l", 1000)
    store = Store(req.block_hashes)
    producer = SchedulerConnector(block_size=BS, lookup=store, loads=False, saves=True)
    assert admit(producer, req, range(8)) == 0 and store.calls == 0
    assert producer.build_meta(step(new=[(req, range(8), 0)], scheduled={"l": 1000})).saves
    consumer = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=False)
    req2 = request("m", 1000)
    assert admit(consumer, req2, range(8)) == 896
    meta = consumer.build_meta(step(new=[(req2, range(8), 896)], scheduled={"m": 104}))
    assert meta.loads and not meta.saves
    assert consumer.request_finished(req2) is False


def test_external_tokens_without_a_lookup_are_reported_failed():
    conn = SchedulerConnector(block_size=BS, lookup=Store(), loads=True, saves=True)
    req = request("n", 1000)
    conn.update_state_after_alloc(req, blocks(range(8)), 256)  # no lookup promised these
    meta = conn.build_meta(step(new=[(req, range(8), 256)], scheduled={"n": 744}))
    assert meta.loads == []
    assert meta.failed_loads == {"n": [0, 1]}


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        SchedulerConnector(block_size=0, lookup=None, loads=True, saves=True)


def test_prompt_saves_carry_the_chain_before_them_and_output_blocks_do_not():
    """(from the server follow-up engineer) The server keeps a saved chain's head ahead of its
    tail for eviction only if the save names the head too: prompt saves send it along."""
    req = request("q", 1000)
    store = Store(req.block_hashes[:3])
    conn = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=True)
    admit(conn, req, range(20, 28))
    conn.build_meta(step(new=[(req, range(20, 28), 384)], scheduled={"q": 616}))
    m2 = conn.build_meta(step(cached=[("q", None, 1000)], scheduled={"q": 1}))
    (save,) = m2.saves
    assert save.block_ids == [23, 24, 25, 26]
    assert save.head_block_ids == [20, 21, 22]
    assert save.head_hashes == [bytes(h) for h in req.block_hashes[:3]]
    req.num_computed_tokens = 1000
    for _ in range(24):  # decode until block 7 (the first block with output tokens) fills
        req.append_output_token_ids(5)
    meta = conn.build_meta(step(cached=[("q", None, 1023)], scheduled={"q": 1}))
    (save,) = meta.saves
    assert save.block_ids == [27] and save.head_block_ids == [] and save.head_hashes == []


class ArrivingStore:
    """A chain whose blocks are on their way into the server: the first answers say waiting, with
    ``ready`` blocks readable; after ``arrive_after`` calls every block is ready."""

    def __init__(self, ready: int, total: int, arrive_after: int, sources=("DRAM",)):
        self.ready, self.total, self.arrive_after = ready, total, arrive_after
        self.sources = sources
        self.calls: list[bool] = []  # the poll flag of each call

    def __call__(self, hashes, poll=False):
        from pegaflow.connector.scheduler import LookupAnswer

        self.calls.append(poll)
        n = min(self.total, len(hashes))
        src = tuple(self.sources[i % len(self.sources)] for i in range(n))
        if len(self.calls) <= self.arrive_after:
            return LookupAnswer(self.ready, True, src)
        return LookupAnswer(n, False, src)


def test_blocks_on_their_way_make_vllm_ask_again_and_are_polled_as_loads(monkeypatch):
    import pegaflow.connector.scheduler as sched

    clock = [100.0]
    monkeypatch.setattr(sched.time, "monotonic", lambda: clock[0])
    store = ArrivingStore(ready=0, total=5, arrive_after=2, sources=("SSD",))
    s = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=False)
    r = request("a", 6 * BS + 10)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # the first lookup: counted
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # within the poll interval: no call
    assert store.calls == [False]
    clock[0] += 0.01
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # a poll, still waiting
    clock[0] += 0.01
    assert s.get_num_new_matched_tokens(r, 0) == (5 * BS, False)  # arrived
    assert store.calls == [False, True, True]
    assert s.lookups == 1 and s.lookups_waited == 1 and s.lookups_polled == 2
    s.update_state_after_alloc(r, blocks(range(7)), 5 * BS)
    assert s.hit_sources(r, 5 * BS) == {"SSD": 5 * BS}


def test_a_request_waits_no_longer_than_the_max_wait_then_takes_what_is_ready(monkeypatch):
    import pegaflow.connector.scheduler as sched

    clock = [0.0]
    monkeypatch.setattr(sched.time, "monotonic", lambda: clock[0])
    store = ArrivingStore(ready=2, total=5, arrive_after=10**6)  # never arrives
    s = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=False, max_wait_s=0.5)
    r = request("b", 6 * BS + 10)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    for _ in range(10):
        clock[0] += 0.04
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    clock[0] += 0.2
    assert s.get_num_new_matched_tokens(r, 0) == (2 * BS, False)
    assert s.waits_given_up == 1


def test_hit_sources_split_a_load_by_where_each_block_was_found():
    store = ArrivingStore(ready=6, total=6, arrive_after=0, sources=("DRAM", "DRAM", "SSD", "REMOTE"))
    s = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=False)
    r = request("c", 6 * BS + 10)
    assert s.get_num_new_matched_tokens(r, 0) == (6 * BS, False)
    s.update_state_after_alloc(r, blocks(range(7)), 6 * BS)
    # blocks 0..5 were DRAM, DRAM, SSD, REMOTE, DRAM, DRAM
    assert s.hit_sources(r, 6 * BS) == {"DRAM": 4 * BS, "SSD": BS, "REMOTE": BS}


class SearchingStore:
    """A chain another node holds: the first answer is still searching (nothing found yet), the next
    sees the blocks arriving from the peer, the last finds them readable here (DRAM)."""

    def __init__(self, total: int):
        self.total = total
        self.answers = 0

    def __call__(self, hashes, poll=False):
        from pegaflow.connector.scheduler import LookupAnswer

        self.answers += 1
        if self.answers == 1:
            return LookupAnswer(0, True, ())
        if self.answers == 2:
            return LookupAnswer(0, True, ("REMOTE",) * self.total)
        return LookupAnswer(self.total, False, ("DRAM",) * self.total)


def test_blocks_a_searching_lookup_did_not_see_keep_the_source_a_later_poll_found_them_at(monkeypatch):
    import pegaflow.connector.scheduler as sched

    clock = [100.0]
    monkeypatch.setattr(sched.time, "monotonic", lambda: clock[0])
    s = SchedulerConnector(block_size=BS, lookup=SearchingStore(total=4), loads=True, saves=False)
    r = request("p2p", 5 * BS + 3)
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # searching
    clock[0] += 0.01
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # arriving from the peer
    clock[0] += 0.01
    assert s.get_num_new_matched_tokens(r, 0) == (4 * BS, False)  # landed: DRAM now
    s.update_state_after_alloc(r, blocks(range(6)), 4 * BS)
    assert s.hit_sources(r, 4 * BS) == {"REMOTE": 4 * BS}


def test_without_waiting_a_waiting_answer_is_taken_as_it_is():
    store = ArrivingStore(ready=3, total=5, arrive_after=10**6)
    s = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=False, max_wait_s=0.0)
    assert s.get_num_new_matched_tokens(request("d", 6 * BS + 10), 0) == (3 * BS, False)


def test_an_idle_engine_sleeps_until_the_next_poll_instead_of_spinning(monkeypatch):
    import pegaflow.connector.scheduler as sched

    clock, slept = [100.0], []

    def sleep(seconds):
        slept.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(sched.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(sched.time, "sleep", sleep)
    store = ArrivingStore(ready=0, total=5, arrive_after=3)
    s = SchedulerConnector(block_size=BS, lookup=store, loads=True, saves=False)
    r = request("idle", 6 * BS + 10)
    s.build_meta(step())  # a step that scheduled nothing: every request waits
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)  # the first lookup
    clock[0] += 0.001
    # The engine is idle: sleep until the poll is due, then poll (not an instant "ask again").
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert slept == [pytest.approx(sched.POLL_INTERVAL_S - 0.001)] and store.calls == [False, True]
    # At most once per step.
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert len(slept) == 1 and store.calls == [False, True]
    # A step that ran something: never sleeps (other requests would wait behind the lookup).
    other = request("busy", 2 * BS)
    s.build_meta(step(new=[(other, [9, 10], 0)], scheduled={"busy": 2 * BS}))
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    assert len(slept) == 1 and s.idle_waits == 1


def test_a_lookup_that_raises_means_no_hits_and_the_request_goes_on():
    """An error of ours in the lookup path (inside vLLM's schedule()) is a request without external
    hits: its blocks are then saved as a cold request's are."""

    def broken(hashes, poll=False):
        raise KeyError("a bookkeeping bug")

    req = request("g", 1000)
    conn = SchedulerConnector(block_size=BS, lookup=broken, loads=True, saves=True)
    assert admit(conn, req, range(8)) == 0
    meta = conn.build_meta(step(new=[(req, range(8), 0)], scheduled={"g": 1000}))
    assert meta.loads == []
    assert [s.block_ids for s in meta.saves] == [list(range(7))]


# An error of ours in the bookkeeping of vLLM's schedule() (a bug, a vLLM object shaped otherwise than
# we expect) must neither reach vLLM nor leave it counting on KV nobody loads or freeing blocks a save
# still reads. Each test breaks one step of the real bookkeeping and checks what vLLM is then told.


def _broken(*args, **kwargs):
    raise AttributeError("a bookkeeping bug")


def test_an_error_planning_a_load_reports_its_blocks_failed_and_saves_nothing(monkeypatch):
    from pegaflow.connector import scheduler

    req = request("p", 1000)
    conn = SchedulerConnector(block_size=BS, lookup=Store(req.block_hashes[:5]), loads=True, saves=True)
    ext, _ = conn.get_num_new_matched_tokens(req, 2 * BS)  # two blocks in vLLM's prefix cache
    assert ext == 3 * BS
    monkeypatch.setattr(scheduler, "BlockTransfer", _broken)
    conn.update_state_after_alloc(req, blocks(range(8)), ext)
    monkeypatch.undo()
    meta = conn.build_meta(step(new=[(req, range(8), 5 * BS)], scheduled={"p": 1000 - 5 * BS}))
    # the external blocks only: the local prefix may be shared with other requests
    assert meta.failed_loads == {"p": [2, 3, 4]}
    assert meta.loads == [] and meta.saves == []
    later = conn.build_meta(step(cached=[("p", None, 2 * BS)], scheduled={"p": 1000 - 2 * BS}))
    assert later.saves == []  # computed after a failed plan: never stored
    assert conn.request_finished(req) is False


def test_an_error_building_a_step_fails_its_loads_hands_back_held_blocks_and_passes_preemptions(monkeypatch):
    held, loading, other = request("h", 300), request("q", 1000, seed=1), request("r", 600, seed=2)
    conn = SchedulerConnector(block_size=BS, lookup=Store(loading.block_hashes[:3]), loads=True, saves=True)
    admit(conn, held, range(3))
    admit(conn, other, range(10, 15))
    conn.build_meta(
        step(new=[(held, range(3), 0), (other, range(10, 15), 0)], scheduled={"h": 300, "r": 600})
    )
    assert conn.request_finished(held) is True  # its saves may still be copying
    assert admit(conn, loading, range(20, 28)) == 3 * BS
    monkeypatch.setattr(conn, "_plan_saves", _broken)
    meta = conn.build_meta(
        step(new=[(loading, range(20, 28), 3 * BS)], scheduled={"q": 1000 - 3 * BS}, preempted={"r"})
    )
    monkeypatch.undo()
    assert meta.loads == [] and meta.saves == []
    assert meta.failed_loads == {"q": [20, 21, 22]}  # vLLM recomputes them
    assert meta.delayed_free_req_ids == ["h"]  # handed back, not held forever
    assert meta.preempted_req_ids == ["r"]  # the workers settle saves reading its blocks
    # the request that was to load saves nothing from now on; the others go on as before
    after = conn.build_meta(
        step(
            cached=[("q", None, 3 * BS), ("r", None, 0)],
            scheduled={"q": 1000 - 3 * BS, "r": 600},
            resumed={"r"},
        )
    )
    assert "q" not in {s.req_id for s in after.saves}
    assert after.failed_loads == {} and after.delayed_free_req_ids == []


def test_unreadable_preemptions_count_every_tracked_request_as_preempted(monkeypatch):
    a, b = request("s", 600), request("t", 600, seed=3)
    conn = SchedulerConnector(block_size=BS, lookup=Store(), loads=True, saves=True)
    admit(conn, a, range(5))
    admit(conn, b, range(5, 10))
    conn.build_meta(step(new=[(a, range(5), 0), (b, range(5, 10), 0)], scheduled={"s": 600, "t": 600}))

    class Unreadable:
        scheduled_new_reqs = ()

        def __getattr__(self, name):
            raise AttributeError(name)

    meta = conn.build_meta(Unreadable())
    assert meta.preempted_req_ids == ["s", "t"]


def test_an_error_finishing_a_request_keeps_its_blocks_until_the_workers_hand_them_back(monkeypatch):
    req = request("u", 1000)
    conn = SchedulerConnector(block_size=BS, lookup=Store(), loads=True, saves=True)
    admit(conn, req, range(8))
    conn.build_meta(step(new=[(req, range(8), 0)], scheduled={"u": 512}))
    monkeypatch.setattr(conn, "_unsaved_blocks", _broken)
    # a save of its blocks may still be copying: freeing them now could store another request's KV
    assert conn.request_finished(req) is True
    monkeypatch.undo()
    assert conn.build_meta(step()).delayed_free_req_ids == ["u"]
    assert conn.num_tracked_requests == 0


def test_an_error_splitting_hits_by_tier_counts_them_as_dram(monkeypatch):
    req = request("v", 1000)
    conn = SchedulerConnector(block_size=BS, lookup=Store(req.block_hashes[:3]), loads=True, saves=True)
    admit(conn, req, range(8))
    monkeypatch.setattr(conn, "_reqs", None)  # any error of ours
    assert conn.hit_sources(req, 3 * BS) == {"DRAM": 3 * BS}
