"""The pool's size cannot be changed by anyone holding its fd (issue 12 F1): the memfd is sealed against
shrinking and growing before the fd is passed, so a client's ftruncate gets EPERM and every other
client's mapping and the cached blocks are unaffected."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from pegaflow.client import PegaClient, read_blocks
from pegaflow.server.config import MIB
from pegaflow.server.endpoints.tests.support import LAYOUT, save_and_load
from pegaflow.server.testing import ServerProcess
from pegaflow.server.tiers.dram.region import PoolRegion, read_meminfo
from pegaflow.server.tiers.dram.tests.support import assert_size_is_fixed

pytestmark = pytest.mark.timeout(120)


def test_the_pool_memfd_is_sealed_against_resizing():
    region = PoolRegion.create(8 * MIB)
    try:
        assert region.sealed
        assert_size_is_fixed(region.fd, 8 * MIB)
        region.buffer[:4] = b"ok!!"  # writing bytes is still what a pool is for
        assert bytes(region.buffer[:4]) == b"ok!!"
    finally:
        region.close()


@pytest.mark.skipif(
    (read_meminfo().get("HugePages_Free", 0) - read_meminfo().get("HugePages_Rsvd", 0)) < 4,
    reason="needs 4 free 2 MiB huge pages (echo N > /proc/sys/vm/nr_hugepages)",
)
def test_the_hugetlb_pool_memfd_is_sealed_too():
    region = PoolRegion.create(4 * MIB, use_hugepages=True)
    try:
        assert region.sealed and region.hugepages
        assert_size_is_fixed(region.fd, 4 * MIB)
    finally:
        region.close()


def test_a_pool_file_cannot_be_sealed_and_the_server_says_so(tmp_path, caplog):
    pool_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if pool_dir is None or os.statvfs(pool_dir).f_bavail * os.statvfs(pool_dir).f_frsize < 64 * MIB:
        pytest.skip("needs a tmpfs at /dev/shm with room for the pool")
    caplog.set_level(logging.WARNING, logger="pegaflow.server.tiers.dram.region")
    region = PoolRegion.create(4 * MIB, pool_dir=pool_dir)
    try:
        assert not region.sealed  # Linux seals memfds only (tmpfs / hugetlbfs files refuse: EPERM)
        assert any("cannot be sealed" in r.getMessage() for r in caplog.records)
    finally:
        region.close()


def test_a_client_resizing_its_pool_fd_gets_eperm_and_nobody_notices(tmp_path):
    with ServerProcess(tmp_path, pool_size="64mb") as srv:
        with PegaClient(srv.addr, timeout_s=10.0) as victim:
            inst = victim.register_instance(LAYOUT)
            data, out, hits = save_and_load(victim, inst, "before")
            assert hits == 8 and np.array_equal(out, data)
            with PegaClient(srv.addr, timeout_s=10.0) as hostile:
                pool = hostile._conn.pool
                fd = os.dup(pool._fd)  # the very fd the server passed
                try:
                    assert_size_is_fixed(fd, pool.size_bytes)
                finally:
                    os.close(fd)
            # The victim's mapping never faulted and its blocks are intact; a new client is admitted.
            hit = victim.query_prefix(inst, [f"before-{i}".encode() for i in range(8)], lease=True)
            again = np.zeros_like(data)
            read_blocks(victim.pool_view(hit.epoch), hit.locations, again)
            victim.release(hit.lease_id)
            assert hit.num_hits == 8 and np.array_equal(again, data)
            with PegaClient(srv.addr, timeout_s=10.0) as newcomer:
                assert newcomer.pool_view().nbytes == victim.pool_view().nbytes
            data, out, hits = save_and_load(victim, inst, "after")
            assert hits == 8 and np.array_equal(out, data)
