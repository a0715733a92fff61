"""RemoteSource's lookup step: a metaserver that did not answer is not "nobody holds it".

A lookup that timed out (a loaded host, a leader change) must leave the chain askable at once: the
next request for it goes to the metaserver again. "Nobody holds it" is remembered for
negative_ttl_s, so that a chain no node holds does not cost a metaserver call per request.
"""

from __future__ import annotations

import time

from pegaflow.server.peers.remote_source import RemoteOptions, RemoteSource


class _Publisher:
    """Answers every lookup with ``answer`` (None: no answer, as BlockPublisher.try_locate)."""

    def __init__(self, answer):
        self.answer = answer
        self.calls = 0

    def try_locate(self, namespace, hashes, timeout_s):
        self.calls += 1
        return self.answer


def _settle(source: RemoteSource, key_hash: bytes) -> None:
    deadline = time.monotonic() + 5
    while source.searching(0, key_hash):
        assert time.monotonic() < deadline, "the lookup did not finish"
        time.sleep(0.001)


def _ask_twice(answer) -> tuple[_Publisher, RemoteSource]:
    publisher = _Publisher(answer)
    source = RemoteSource(engine=None, publisher=publisher, transport=None, options=RemoteOptions(workers=1))
    try:
        for _ in range(2):
            source.request("ns", 0, 4096, [b"h" * 16, b"i" * 16])
            _settle(source, b"h" * 16)
    finally:
        source.close()
    return publisher, source


def test_a_lookup_the_metaserver_did_not_answer_is_asked_again_by_the_next_request():
    publisher, source = _ask_twice(None)
    stats = source.stats()
    assert publisher.calls == 2
    assert stats.locate_failed == 2 and stats.not_located == 0 and stats.negative_hits == 0
    assert not stats.failures  # no answer is a miss, not a failed pull


def test_a_chain_nobody_holds_is_not_asked_about_again_for_a_while():
    publisher, source = _ask_twice([])
    stats = source.stats()
    assert publisher.calls == 1
    assert stats.not_located == 1 and stats.negative_hits == 1 and stats.locate_failed == 0
