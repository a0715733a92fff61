"""Tenant regions (--tenant-file region=SIZE): the pool and each tenant's region are memfds of their
own, sealed like the pool, mapped back to back in the server as one buffer. A client maps one part's
fd: what it writes there is what the server sees at that part's base, and nothing of another part is
reachable through it."""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np
import pytest

from pegaflow.server.config import MIB
from pegaflow.server.tiers.dram.region import PoolRegion
from pegaflow.server.tiers.dram.tests.support import assert_size_is_fixed

SLAB = 2 * MIB


@pytest.fixture
def region():
    # The pool is rounded down to whole slabs, each region up: 9 -> 8 MiB, 3 -> 4 MiB, 1 -> 2 MiB.
    region = PoolRegion.create_with_parts(9 * MIB, [("team-a", 3 * MIB), ("team-b", 1 * MIB)], SLAB)
    yield region
    region.close()


def test_parts_are_whole_slabs_back_to_back_each_sealed(region):
    layout = [(p.name, p.base, p.size_bytes) for p in region.parts]
    assert layout == [("", 0, 8 * MIB), ("team-a", 8 * MIB, 4 * MIB), ("team-b", 12 * MIB, 2 * MIB)]
    assert region.size_bytes == 14 * MIB and len(region.buffer) == 14 * MIB
    assert region.fd == region.parts[0].fd and region.sealed
    for part in region.parts:
        assert_size_is_fixed(part.fd, part.size_bytes)
    assert region.part("team-b").fd == region.parts[2].fd
    with pytest.raises(KeyError):
        region.part("team-c")


def test_a_parts_own_mapping_and_the_servers_buffer_are_the_same_bytes(region):
    server = np.frombuffer(region.buffer, dtype=np.uint8)
    server[:] = 0xEE  # the server writes everywhere
    a = region.part("team-a")
    client = mmap.mmap(a.fd, a.size_bytes, mmap.MAP_SHARED)  # what a team-a client maps
    try:
        assert len(client) == 4 * MIB  # the part, not the pool: nothing else is reachable through it
        assert client[:4] == b"\xee" * 4 and client[-4:] == b"\xee" * 4
        client[100:108] = b"team-a!!"
        assert bytes(server[a.base + 100 : a.base + 108]) == b"team-a!!"
        end = a.base + a.size_bytes
        server[end - 8 : end] = np.frombuffer(b"the-end!", dtype=np.uint8)
        assert client[-8:] == b"the-end!"
        # Its neighbours did not move: the pool's last byte and team-b's first are the server's.
        assert server[a.base - 1] == 0xEE and server[end] == 0xEE
    finally:
        client.close()


def test_file_at_names_the_memfd_and_offset_sendfile_needs(region):
    assert region.file_at(0) == (region.parts[0].fd, 0)
    assert region.file_at(8 * MIB - 1) == (region.parts[0].fd, 8 * MIB - 1)
    assert region.file_at(8 * MIB + 5) == (region.part("team-a").fd, 5)
    assert region.file_at(13 * MIB) == (region.part("team-b").fd, MIB)
    np.frombuffer(region.buffer, dtype=np.uint8)[13 * MIB : 13 * MIB + 4] = np.frombuffer(b"xyzw", np.uint8)
    fd, offset = region.file_at(13 * MIB)
    assert os.pread(fd, 4, offset) == b"xyzw"


def test_close_releases_every_parts_fd():
    region = PoolRegion.create_with_parts(4 * MIB, [("t", 2 * MIB)], SLAB)
    fds = [p.fd for p in region.parts]
    region.close()
    for fd in fds:
        with pytest.raises(OSError) as err:
            os.fstat(fd)
        assert err.value.errno == errno.EBADF
    with pytest.raises(ValueError, match="closed"):
        region.buffer  # noqa: B018


def test_a_pool_smaller_than_a_slab_beside_regions_is_refused():
    from pegaflow.server.errors import PoolCapacityError

    with pytest.raises(PoolCapacityError, match="smaller than one slab"):
        PoolRegion.create_with_parts(1 * MIB, [("t", 2 * MIB)], SLAB)
    with pytest.raises(ValueError, match="2 MiB"):
        PoolRegion.create_with_parts(8 * MIB, [("t", 2 * MIB)], 3 * MIB)
