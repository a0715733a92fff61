"""The TCP transport between real hosts: processes in network namespaces on one switch.

Node a and node c serve blocks of known bytes out of a memfd (server/peers/testing.py), node b
requests. Peers are killed for real (SIGKILL), links go down for real (``ip link set down``),
corruption happens on a real stream (a relay that flips a byte in flight), and every check of
"nothing landed late" paints the requester's slots after the fetch resolved and looks again
once the network has had every chance to deliver stray bytes.
"""

from __future__ import annotations

import base64

import pytest

from pegaflow.common.testing.netns import NetnsLab, require_netns
from pegaflow.common.wire import peer_frames as frames
from pegaflow.server.peers.testing import PeerAgent, block_hash, wait_until

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
ODD = MIB + 4096 + 7  # not a multiple of anything: slot padding and tails are exercised


@pytest.fixture(scope="module")
def lab():
    require_netns()
    with NetnsLab() as lab:
        nodes = {name: lab.add_node(name) for name in ("a", "b", "c")}
        lab.nodes = nodes
        lab.net = lab.switch(list(nodes.values()))
        yield lab


def serve(lab, node: str, *args: str) -> PeerAgent:
    n = lab.nodes[node]
    return PeerAgent.start(n, ["serve", "--host", n.addr, *args])


def requester(lab, streams: int = 4) -> PeerAgent:
    return PeerAgent.start(lab.nodes["b"], ["requester", "--streams", str(streams)])


def served(agent: PeerAgent) -> dict:
    return agent.call({"cmd": "stats"})


def no_unsent_sockets(lab, node: str) -> bool:
    """No socket in the node still trying to deliver data (FIN_WAIT1 / LAST_ACK / CLOSING)."""
    out = lab.nodes[node].run(["ss", "-Htn", "state", "fin-wait-1", "state", "last-ack", "state", "closing"])
    return not out.stdout.strip()


def test_fetches_are_byte_identical_for_several_sizes_and_stream_counts(lab):
    a = serve(lab, "a", "--blocks", "24", "--block-bytes", str(ODD))
    c = serve(
        lab, "c", "--blocks", "6", "--block-bytes", str(4 * MIB), "--keep-checksums", "--send-mode", "sendmsg"
    )
    try:
        for streams in (1, 3):
            b = requester(lab, streams)
            try:
                assert b.call({"cmd": "connect", "peer": a.control, "name": "a"})["streams"] == streams
                assert b.call({"cmd": "connect", "peer": c.control, "name": "c"})["ok"]
                for first, count in ((0, 1), (5, 7), (0, 24)):
                    r = b.call(
                        {"cmd": "fetch", "peer": "a", "first": first, "count": count, "block_bytes": ODD}
                    )
                    assert r["num_blocks"] == count and r["statuses"] == ["ok"] * count, r
                    assert r["verified"] and r["bytes_ok"] == count * ODD
                # checksums announced by OpenTransfer (the store kept them) and carried by the frames
                r = b.call(
                    {"cmd": "fetch", "peer": "c", "count": 6, "block_bytes": 4 * MIB, "canary_wait": 0.2}
                )
                assert r["statuses"] == ["ok"] * 6 and r["verified"] and r["canary_intact"], r
                # a prefix longer than what the peer holds: the leading blocks it has
                r = b.call({"cmd": "fetch", "peer": "c", "first": 4, "count": 5, "block_bytes": 4 * MIB})
                assert r["num_blocks"] == 2 and r["statuses"] == ["ok", "ok"] and r["verified"]
                stats = b.call({"cmd": "stats"})
                assert stats["blocks_failed"] == dict.fromkeys(stats["blocks_failed"], 0)
                assert stats["open_streams"] == 2 * streams
            finally:
                b.kill()
        assert served(a)["pinned"] == 0 and served(c)["pinned"] == 0  # every transfer was closed
    finally:
        a.kill()
        c.kill()


def test_peer_killed_mid_transfer_ends_the_fetch_and_other_peers_keep_serving(lab):
    port_a = lab.net.port(lab.nodes["a"])
    a = serve(lab, "a", "--blocks", "32", "--block-bytes", str(MIB))
    c = serve(lab, "c", "--blocks", "8", "--block-bytes", str(MIB))
    b = requester(lab)
    port_a.limit_rate("100mbit")  # 32 MiB take ~2.7 s: long enough to be cut in the middle
    try:
        assert b.call({"cmd": "connect", "peer": a.control, "name": "a"})["ok"]
        assert b.call({"cmd": "connect", "peer": c.control, "name": "c"})["ok"]
        fetch = {"cmd": "fetch", "peer": "a", "count": 32, "block_bytes": MIB, "deadline": 20.0}
        assert b.call({**fetch, "background": True, "tag": "cut"})["num_blocks"] == 32
        wait_until(lambda: served(a)["serve"]["blocks_sent"] >= 4, 10, what="a sending")
        a.kill()  # SIGKILL
        r = b.call({"cmd": "result", "tag": "cut", "paint": True})
        assert r["seconds"] < 8.0, r  # at once on the reset/FIN (a's shaped queue drains first), not at 20 s
        assert "peer_gone" in r["statuses"] and r["verified"], r
        assert set(r["statuses"]) <= {"ok", "peer_gone"}
        wait_until(lambda: no_unsent_sockets(lab, "a"), 10, what="a's sockets gone")
        assert b.call({"cmd": "canary", "tag": "cut"})["intact"]
        # the requester keeps working with the other peer, on the same transport
        r = b.call({"cmd": "fetch", "peer": "c", "count": 8, "block_bytes": MIB, "tag": "other"})
        assert r["statuses"] == ["ok"] * 8 and r["verified"], r
        stats = b.call({"cmd": "stats"})
        assert stats["blocks_failed"]["peer_gone"] >= 1 and stats["fetches_failed"] == 1
    finally:
        port_a.unlimit()
        for agent in (a, b, c):
            agent.kill()


def test_link_down_mid_transfer_ends_at_the_deadline_and_nothing_lands_later(lab):
    port_a = lab.net.port(lab.nodes["a"])
    a = serve(lab, "a", "--blocks", "32", "--block-bytes", str(MIB))
    c = serve(lab, "c", "--blocks", "8", "--block-bytes", str(MIB))
    b = requester(lab)
    port_a.limit_rate("100mbit")
    try:
        assert b.call({"cmd": "connect", "peer": a.control, "name": "a"})["ok"]
        assert b.call({"cmd": "connect", "peer": c.control, "name": "c"})["ok"]
        deadline = 2.0
        fetch = {"cmd": "fetch", "peer": "a", "count": 32, "block_bytes": MIB, "deadline": deadline}
        assert b.call({**fetch, "background": True, "tag": "cut"})["num_blocks"] == 32
        wait_until(lambda: served(a)["serve"]["blocks_sent"] >= 2, 10, what="a sending")
        port_a.set_down()  # a partition: no RST, just silence
        r = b.call({"cmd": "result", "tag": "cut", "paint": True, "close": False})
        assert deadline - 0.05 <= r["seconds"] <= deadline + 1.0, r  # resolved at the deadline
        assert "timeout" in r["statuses"] and set(r["statuses"]) <= {"ok", "timeout"}, r
        assert r["verified"]
        # While a is cut off, b still pulls from c.
        r2 = b.call({"cmd": "fetch", "peer": "c", "count": 8, "block_bytes": MIB, "tag": "other"})
        assert r2["statuses"] == ["ok"] * 8, r2
        # Heal the link: a's kernel retransmits what it had queued for the cut streams, and b's
        # closed sockets reset them. Not one of those bytes may reach the painted slots.
        port_a.set_up()
        port_a.unlimit()
        wait_until(lambda: no_unsent_sockets(lab, "a"), 30, what="a's queued bytes delivered or reset")
        assert b.call({"cmd": "canary", "tag": "cut"})["intact"]
        # The same link works again: its broken streams reconnect for the next fetch.
        r3 = b.call({"cmd": "fetch", "peer": "a", "count": 32, "block_bytes": MIB, "tag": "again"})
        assert r3["statuses"] == ["ok"] * 32 and r3["verified"], r3
    finally:
        port_a.set_up()
        port_a.unlimit()
        for agent in (a, b, c):
            agent.kill()


def test_bytes_flipped_in_flight_fail_their_block_or_stream_and_nothing_bad_is_handed_over(lab):
    block = 256 << 10
    a = serve(lab, "a", "--blocks", "16", "--block-bytes", str(block), "--flip-proxy")
    b = requester(lab, streams=4)
    try:
        frame = frames.HEADER_BYTES + block
        # Stream 0 carries blocks 0, 4, 8, 12: flip a byte of block 4's header (the stream's
        # framing is lost: block 4 and the rest of stream 0 fail PROTOCOL). Stream 1 carries
        # 1, 5, 9, 13: flip a byte of block 1's payload (only block 1 fails its checksum).
        a.call({"cmd": "flip", "conn": 0, "offsets": [frame + 20]})
        a.call({"cmd": "flip", "conn": 1, "offsets": [frames.HEADER_BYTES + 1000]})
        assert b.call({"cmd": "connect", "peer": a.control, "name": "a"})["ok"]
        r = b.call({"cmd": "fetch", "peer": "a", "count": 16, "block_bytes": block, "canary_wait": 0.2})
        expected = ["ok"] * 16
        expected[1] = "checksum"
        for i in (4, 8, 12):
            expected[i] = "protocol"
        assert a.call({"cmd": "flipped"})["flipped"] == 2
        assert r["statuses"] == expected, r
        assert r["verified"] and r["canary_intact"] and r["leading_ok"] == 1
        # The same link recovers: stream 0 reconnects, nothing is flipped any more.
        r = b.call({"cmd": "fetch", "peer": "a", "count": 16, "block_bytes": block})
        assert r["statuses"] == ["ok"] * 16 and r["verified"], r
    finally:
        a.kill()
        b.kill()


def test_a_block_changed_after_its_checksum_was_kept_is_never_handed_over(lab):
    a = serve(lab, "a", "--blocks", "8", "--block-bytes", str(MIB), "--keep-checksums")
    b = requester(lab, streams=2)
    try:
        a.call({"cmd": "scribble", "index": 5})
        assert b.call({"cmd": "connect", "peer": a.control, "name": "a"})["ok"]
        r = b.call({"cmd": "fetch", "peer": "a", "count": 8, "block_bytes": MIB})
        assert r["statuses"] == ["ok"] * 5 + ["checksum"] + ["ok"] * 2, r
        assert r["leading_ok"] == 5 and r["verified"]
    finally:
        a.kill()
        b.kill()


def test_bad_input_on_both_planes_gets_a_clear_status_and_the_peer_keeps_serving(lab):
    a = serve(
        lab, "a", "--blocks", "8", "--block-bytes", str(MIB), "--frame-timeout", "1", "--idle-timeout", "2"
    )
    b = requester(lab, streams=2)
    host, port = lab.nodes["a"].addr, a.hello["data_port"]

    def grpc(method, request):
        return b.call({"cmd": "grpc", "peer": a.control, "method": method, "request": request})

    def raw(**kw):
        return b.call({"cmd": "raw", "host": host, "port": port, **kw})

    try:
        # ---- control plane
        assert grpc("Handshake", {"transport": "udp", "frameVersion": 1})["code"] == "INVALID_ARGUMENT"
        assert grpc("Handshake", {"transport": "rdma", "frameVersion": 1})["code"] == "FAILED_PRECONDITION"
        assert grpc("Handshake", {"transport": "tcp", "frameVersion": 99})["code"] == "FAILED_PRECONDITION"
        hs = grpc("Handshake", {"transport": "tcp", "frameVersion": 1, "nodeId": "b"})
        assert hs["code"] == "OK" and int(hs["response"]["dataPort"]) == port
        link = hs["response"]["linkId"]
        h0 = base64.b64encode(block_hash(0)).decode()  # bytes travel as base64 in protobuf's JSON
        good = {"linkId": link, "namespaceId": "peer-test-ns", "blockHashes": [h0], "ttlMs": 5000}
        assert grpc("OpenTransfer", {**good, "linkId": "nope"})["code"] == "NOT_FOUND"
        assert grpc("OpenTransfer", {**good, "blockHashes": []})["code"] == "INVALID_ARGUMENT"
        assert grpc("OpenTransfer", {**good, "blockHashes": ["A" * 88]})["code"] == "INVALID_ARGUMENT"  # 66 B
        assert grpc("OpenTransfer", {**good, "ttlMs": 0})["code"] == "INVALID_ARGUMENT"
        assert grpc("OpenTransfer", {**good, "ttlMs": 10**9})["code"] == "INVALID_ARGUMENT"
        assert grpc("OpenTransfer", {**good, "namespaceId": ""})["code"] == "INVALID_ARGUMENT"
        miss = grpc("OpenTransfer", {**good, "namespaceId": "other"})
        assert miss["code"] == "OK" and miss["response"].get("numBlocks", 0) == 0  # a miss, not an error
        assert grpc("RenewTransfer", {"transferId": "AAAA", "ttlMs": 10})["code"] == "INVALID_ARGUMENT"
        unknown = "A" * 22 + "=="  # 16 zero bytes
        assert grpc("RenewTransfer", {"transferId": unknown, "ttlMs": 10})["code"] == "NOT_FOUND"
        assert grpc("CloseTransfer", {"transferId": unknown})["code"] == "OK"  # idempotent
        assert grpc("CloseTransfer", {"transferId": "AAAA"})["code"] == "INVALID_ARGUMENT"
        opened = grpc("OpenTransfer", good)
        assert opened["code"] == "OK" and opened["response"]["numBlocks"] == 1
        tid = opened["response"]["transferId"]
        assert grpc("RenewTransfer", {"transferId": tid, "ttlMs": 5000})["code"] == "OK"

        # ---- data plane
        tid_hex = base64.b64decode(tid).hex()
        r = raw(send_hex=bytes(range(56)).hex())  # garbage
        assert r["status"] == "PROTOCOL" and r["fatal"] and r["closed_after"], r
        block_frame = frames.encode_block_header(bytes(16), 0, 0, 0)
        r = raw(send_hex=block_frame.hex())  # a well-formed frame that is not a READ
        assert r["status"] == "PROTOCOL" and r["fatal"] and r["closed_after"], r
        r = raw(transfer_id="00" * 16, indices=[0])
        assert r["status"] == "UNKNOWN_TRANSFER" and not r["fatal"], r
        r = raw(transfer_id=tid_hex, indices=[0, 7])  # block 7 is not in this one-block transfer
        assert r["status"] == "BAD_REQUEST" and not r["fatal"] and r["block_index"] == 7, r
        bad_body = bytearray(frames.encode_read(base64.b64decode(tid), [0], 5.0))
        bad_body[-1] ^= 0xFF  # the READ's payload no longer matches its checksum
        r = raw(send_hex=bad_body.hex())
        assert r["status"] == "BAD_REQUEST" and not r["fatal"], r
        r = raw(transfer_id=tid_hex, indices=[0])
        assert r["type"] == "BLOCK" and r["block_index"] == 0, r  # that transfer still serves

        # wrong lengths and indices from a requester: the peer's answer never lands as good
        b.call({"cmd": "connect", "peer": a.control, "name": "a"})
        r = b.call(
            {"cmd": "fetch", "peer": "a", "count": 3, "block_bytes": MIB, "tamper": {"length": MIB - 8}}
        )
        assert set(r["statuses"]) == {"protocol"}, r
        r = b.call({"cmd": "fetch", "peer": "a", "count": 2, "block_bytes": MIB, "tamper": {"index": 9}})
        assert set(r["statuses"]) == {"refused"} and "BAD_REQUEST" in r["error"], r

        # clients that connect and stall: closed after the idle / frame timeouts, others unaffected
        b.call({"cmd": "stall", "host": host, "port": port})
        b.call({"cmd": "stall", "host": host, "port": port, "send_hex": "5047"})  # half a header
        r = b.call({"cmd": "fetch", "peer": "a", "count": 8, "block_bytes": MIB})
        assert r["statuses"] == ["ok"] * 8 and r["verified"], r
        wait_until(lambda: all(b.call({"cmd": "stall_closed"})["closed"]), 10, what="stalled clients dropped")

        # a stale index: the peer evicted block 3, so the prefix it pins stops there
        a.call({"cmd": "evict", "index": 3})
        r = b.call({"cmd": "fetch", "peer": "a", "count": 8, "block_bytes": MIB})
        assert r["num_blocks"] == 3 and r["statuses"] == ["ok"] * 3, r

        stats = served(a)["serve"]
        assert stats["error_frames"]["protocol"] == 2 and stats["error_frames"]["bad_request"] >= 3
        assert stats["rpc_errors"]["INVALID_ARGUMENT"] >= 8 and stats["rpc_errors"]["NOT_FOUND"] >= 2
    finally:
        a.kill()
        b.kill()


def test_transfer_leases_expire_when_the_requester_dies(lab):
    a = serve(lab, "a", "--blocks", "16", "--block-bytes", str(MIB), "--ttl-grace", "0.5")
    b = requester(lab)
    try:
        assert b.call({"cmd": "connect", "peer": a.control, "name": "a"})["ok"]
        for _ in range(2):
            r = b.call(
                {"cmd": "fetch", "peer": "a", "count": 16, "block_bytes": MIB, "ttl": 1.0, "close": False}
            )
            assert r["statuses"] == ["ok"] * 16
        before = served(a)
        assert before["pinned"] == 2 and before["serve"]["open_transfers"] == 2
        assert before["serve"]["open_connections"] == 4
        b.kill()  # SIGKILL: it never closes its transfers
        after = wait_until(
            lambda: (s := served(a))["pinned"] == 0 and s["serve"]["open_transfers"] == 0 and s,
            5,
            what="expiry",
        )
        assert after["serve"]["transfers_expired"] == 2
        wait_until(
            lambda: served(a)["serve"]["open_connections"] == 0, 5, what="the dead requester's streams"
        )
        # the peer still serves a new requester
        b2 = requester(lab)
        try:
            assert b2.call({"cmd": "connect", "peer": a.control, "name": "a"})["ok"]
            r = b2.call({"cmd": "fetch", "peer": "a", "count": 16, "block_bytes": MIB})
            assert r["statuses"] == ["ok"] * 16 and r["verified"]
        finally:
            b2.kill()
    finally:
        a.kill()


def test_connecting_to_a_dead_or_unreachable_peer_fails_with_a_cause_by_the_deadline(lab):
    a = serve(lab, "a", "--blocks", "2", "--block-bytes", str(MIB))
    b = requester(lab)
    port_a = lab.net.port(lab.nodes["a"])
    try:
        control = a.control
        port_a.set_down()
        r = b.call({"cmd": "connect", "peer": control, "name": "a", "timeout": 1.0})
        assert not r["ok"] and r["cause"] == "timeout", r
        port_a.set_up()
        a.kill()
        r = b.call({"cmd": "connect", "peer": control, "name": "a", "timeout": 2.0})
        assert not r["ok"] and r["cause"] == "peer_gone", r
    finally:
        port_a.set_up()
        a.kill()
        b.kill()


def test_streams_the_peer_closed_while_idle_are_reopened_without_failing_a_fetch(lab):
    a = serve(lab, "a", "--blocks", "8", "--block-bytes", str(MIB), "--idle-timeout", "0.3")
    b = requester(lab, streams=2)
    try:
        assert b.call({"cmd": "connect", "peer": a.control, "name": "a"})["ok"]
        for _ in range(2):
            wait_until(lambda: served(a)["serve"]["open_connections"] == 0, 10, what="idle streams closed")
            r = b.call({"cmd": "fetch", "peer": "a", "count": 8, "block_bytes": MIB})
            assert r["statuses"] == ["ok"] * 8 and r["verified"], r
        assert b.call({"cmd": "stats"})["stream_connects"] == 6  # 2 at connect, 2 after each idle close
    finally:
        a.kill()
        b.kill()
