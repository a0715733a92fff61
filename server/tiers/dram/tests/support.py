"""Helpers shared by the DRAM tier's tests (Bazel runs each test file alone: they live here)."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest

from pegaflow.server.tiers.dram.region import SIZE_SEALS


def assert_size_is_fixed(fd: int, size: int) -> None:
    """The memfd is sealed against every change of its size and of its seals."""
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SIZE_SEALS == SIZE_SEALS
    for new_size in (0, size // 2, size * 2):
        with pytest.raises(OSError) as err:
            os.ftruncate(fd, new_size)
        assert err.value.errno == errno.EPERM
    with pytest.raises(OSError) as err:
        os.posix_fallocate(fd, 0, size * 2)  # growing by allocation is refused too
    assert err.value.errno == errno.EPERM
    with pytest.raises(OSError) as err:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # and nobody can change the seals
    assert err.value.errno == errno.EPERM
    assert os.fstat(fd).st_size == size
