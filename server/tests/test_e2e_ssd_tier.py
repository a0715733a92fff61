"""The L3 SSD tier end to end: a real pegaflow-server process with the seed's SSD flags and real
O_DIRECT files, real clients, a real SIGKILL.

- spill and promote: blocks pushed out of a small DRAM pool come back from SSD byte-identical;
- restart: after kill -9 a new server on the same files serves those blocks again;
- corruption: a flipped byte in the data file is a miss (counted), never wrong bytes;
- faults on a real loop-device file system: filled after start (the preallocated files keep
  working), and a real EIO from the device (the tier turns off, one log line, DRAM carries on).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from pegaflow.client import KvLayout, PegaClient, write_blocks
from pegaflow.server.testing import ServerProcess, wait_for
from pegaflow.server.tiers.ssd.testing import MIB, fill_fs, loop_fs, shrink_device

pytestmark = pytest.mark.timeout(300)

BLOCK = 256 * 1024
LAYOUT = dict(
    model_id="ssd-e2e", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
    block_bytes=BLOCK, num_layers=2, tp_size=1, tp_rank=0, mla=False, extra="",
)  # fmt: skip
POOL = "16mb"  # 64 blocks
CHAIN = 24


def pattern(tag: str, i: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng([len(tag), i, sum(tag.encode())]).bytes(BLOCK), np.uint8)


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def server(work, ssd_dir, capacity="512mb", **extra) -> ServerProcess:
    args = ["--ssd-cache-path", str(ssd_dir), "--ssd-cache-capacity", capacity, "--ssd-segment-size", "16mb"]
    args += ["--ssd-write-policy", extra.pop("policy", "on-seal")]
    return ServerProcess(work, pool_size=POOL, extra_args=args).start()


def save_chain(client: PegaClient, inst, tag: str, n: int) -> None:
    hs = hashes(tag, n)
    for lo in range(0, n, 8):
        batch = client.allocate(inst, hs[lo : lo + 8])
        rows = [pattern(tag, i) for i in range(lo, lo + len(batch.allocations))]
        write_blocks(client.pool_view(batch.epoch), batch.allocations, rows)
        if batch.save_id:
            client.seal(batch.save_id)


def load_chain(client: PegaClient, inst, tag: str, n: int) -> tuple[int, list[bool], object]:
    """(blocks found, per found block whether its bytes are the saved ones, the hit)."""
    hit = client.query_prefix(inst, hashes(tag, n), lease=True, timeout_s=20)
    if not hit.lease_id:
        return 0, [], hit
    locations = client.load_blocks(inst, hit.lease_id, timeout_s=20)
    view = client.pool_view(hit.epoch)
    same = [
        bool(np.array_equal(view[loc.offset : loc.offset + BLOCK], pattern(tag, i)))
        for i, loc in enumerate(locations)
    ]
    client.release(hit.lease_id)
    return len(locations), same, hit


def push_out_of_dram(client, inst) -> None:
    for round_ in range(3):  # 3 x the pool of other blocks
        save_chain(client, inst, f"filler{round_}", 64)
    # The fillers' own SSD writes hold their DRAM slots until they land (up to the whole 16 MiB pool
    # on a slow disk), and a promotion with no DRAM slot to land in is a miss (promotions_dropped):
    # the chain is looked up once they are done, so the test does not race the disk.
    wait_for(lambda: client.stats().demoting_bytes == 0, 30, what="the fillers' SSD writes")


@pytest.fixture
def ssd_dir(tmp_path):
    d = tmp_path / "ssd"
    d.mkdir()
    return d


def wait_written(client, n: int) -> None:
    def written() -> bool:
        stats = client.stats()
        return stats.ssd_blocks >= n and stats.demoting_bytes == 0

    wait_for(written, 30, what=f"{n} blocks written to SSD")


def test_blocks_evicted_from_dram_are_promoted_from_ssd_byte_identical(tmp_path, ssd_dir):
    srv = server(tmp_path / "srv", ssd_dir)
    try:
        with PegaClient(srv.addr, timeout_s=10) as c:
            inst = c.register_instance(KvLayout(**LAYOUT))
            save_chain(c, inst, "keep", CHAIN)
            wait_written(c, CHAIN)
            push_out_of_dram(c, inst)
            first = c.query_prefix(inst, hashes("keep", CHAIN), timeout_s=20)
            assert first.num_hits + first.pending == CHAIN and first.pending > 0
            found, same, _ = load_chain(c, inst, "keep", CHAIN)
            assert found == CHAIN and all(same)
            stats = c.stats()
            assert stats.promoted_blocks >= first.pending and stats.corrupt_blocks == 0
            ssd = next(t for t in stats.tiers if t.name == "ssd")
            assert ssd.read_bytes >= first.pending * BLOCK and ssd.health == 0
    finally:
        srv.stop()


def test_a_server_killed_with_sigkill_serves_its_ssd_blocks_again_after_restart(tmp_path, ssd_dir):
    srv = server(tmp_path / "a", ssd_dir)
    try:
        with PegaClient(srv.addr, timeout_s=10) as c:
            inst = c.register_instance(KvLayout(**LAYOUT))
            save_chain(c, inst, "durable", CHAIN)
            wait_written(c, CHAIN)
        srv.kill()  # SIGKILL: no shutdown path runs
    finally:
        srv.stop()
    again = server(tmp_path / "b", ssd_dir)
    try:
        with PegaClient(again.addr, timeout_s=10) as c:
            assert c.stats().recovered_blocks >= CHAIN
            inst = c.register_instance(KvLayout(**LAYOUT))  # the same layout: the same namespace
            found, same, hit = load_chain(c, inst, "durable", CHAIN)
            assert found == CHAIN and all(same)
            assert hit.pending == CHAIN  # nothing was in DRAM: every block came from SSD
    finally:
        again.stop()


def test_a_flipped_byte_on_disk_is_a_miss_never_wrong_bytes(tmp_path, ssd_dir):
    srv = server(tmp_path / "a", ssd_dir)
    try:
        with PegaClient(srv.addr, timeout_s=10) as c:
            inst = c.register_instance(KvLayout(**LAYOUT))
            save_chain(c, inst, "flip", 4)
            wait_written(c, 4)
    finally:
        srv.stop()
    data = next(p for p in ssd_dir.iterdir() if p.name.endswith(".data"))
    raw = data.read_bytes()
    marker = pattern("flip", 2)[1000:1032].tobytes()  # bytes of the third block's payload
    at = raw.find(marker)
    assert at > 0
    with open(data, "r+b") as f:
        f.seek(at)
        f.write(bytes([raw[at] ^ 0xFF]))
    again = server(tmp_path / "b", ssd_dir)
    try:
        with PegaClient(again.addr, timeout_s=10) as c:
            inst = c.register_instance(KvLayout(**LAYOUT))
            found, same, _ = load_chain(c, inst, "flip", 4)
            assert found == 2 and all(same)  # the chain ends before the corrupt block
            stats = c.stats()
            assert stats.corrupt_blocks == 1
            assert next(t for t in stats.tiers if t.name == "ssd").corrupt_records >= 1
    finally:
        again.stop()


def ssd_stats(client):
    return next(t for t in client.stats().tiers if t.name == "ssd")


def test_a_file_system_filled_after_start_does_not_stop_the_tier_its_files_are_preallocated(tmp_path):
    with loop_fs(tmp_path, 640) as (mnt, _, _):
        srv = server(tmp_path / "srv", mnt)
        try:
            fill_fs(mnt)  # another program takes every free block
            assert os.statvfs(mnt).f_bavail == 0
            with PegaClient(srv.addr, timeout_s=10) as c:
                inst = c.register_instance(KvLayout(**LAYOUT))
                save_chain(c, inst, "full", CHAIN)
                wait_written(c, CHAIN)
                push_out_of_dram(c, inst)
                found, same, hit = load_chain(c, inst, "full", CHAIN)
                assert found == CHAIN and all(same) and hit.pending > 0
                ssd = ssd_stats(c)
                assert ssd.health == 0 and ssd.write_errors == 0
        finally:
            srv.stop()


def test_an_io_error_from_the_disk_turns_the_tier_off_and_dram_serving_carries_on(tmp_path):
    with loop_fs(tmp_path, 640) as (mnt, dev, image):
        srv = server(tmp_path / "srv", mnt)
        try:
            with PegaClient(srv.addr, timeout_s=10) as c:
                inst = c.register_instance(KvLayout(**LAYOUT))
                save_chain(c, inst, "lost", CHAIN)
                wait_written(c, CHAIN)
                push_out_of_dram(c, inst)
                wait_for(lambda: c.stats().demoting_bytes == 0, 30, what="the fillers' writes")
                shrink_device(dev, image, 2 * MIB)  # every block of the data file now fails: EIO
                # The chain is on SSD only: its promotion reads fail. A miss, never an error or a byte
                # of something else.
                found, same, _ = load_chain(c, inst, "lost", CHAIN)
                assert all(same)
                wait_for(lambda: ssd_stats(c).health == 2, 30, what="the SSD tier to turn itself off")
                ssd = ssd_stats(c)
                assert "Input/output error" in ssd.health_reason
                assert ssd.read_errors >= 1
                again, same_again, _ = load_chain(c, inst, "lost", CHAIN)
                assert again <= found and all(same_again)
                # DRAM serving carries on: a new chain is saved and read back whole.
                save_chain(c, inst, "after", 16)
                found_after, same_after, hit = load_chain(c, inst, "after", 16)
                assert found_after == 16 and all(same_after) and hit.pending == 0
            assert srv.alive()
            off_lines = [ln for ln in srv.log_text().splitlines() if "ERROR" in ln and "off" in ln]
            assert len(off_lines) == 1, off_lines  # one line, not one per failed I/O
        finally:
            srv.stop()
