"""The native page copy (common/native/page_copy.c) against numpy's copyto it replaces: the same
bytes for the strided views the connector's KvPages and the client's block copies hand it (pages
below and above the streaming threshold, misaligned starts, both directions), the same refusals,
and nothing written on a refusal."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pegaflow.common.native import page_copy
from pegaflow.common.native.optional import OptionalNative

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["numpy", "native"])
def copy_mode(request):
    was = page_copy.is_native()
    assert page_copy.use(request.param == "native"), page_copy.EXTENSION.probe()
    yield request.param
    page_copy.use(was)


def strided(pool: np.ndarray, offset: int, pages: int, page: int, stride: int) -> np.ndarray:
    return np.lib.stride_tricks.as_strided(pool[offset:], (pages, page), (stride, 1))


@pytest.mark.parametrize("page", [4096, 65536, 256 * 1024 + 24])
@pytest.mark.parametrize("skew", [0, 3])
def test_strided_pages_arrive_byte_identical_both_ways(copy_mode, page, skew):
    rng = np.random.default_rng(page + skew)
    layers, pages = 3, 5
    pool = rng.integers(0, 256, size=skew + pages * layers * page + 64, dtype=np.uint8)
    for layer in range(layers):
        src = strided(pool, skew + layer * page, pages, page, layers * page)
        dst = np.zeros((pages, page), dtype=np.uint8)
        page_copy.copy(dst, src)
        assert np.array_equal(dst, src)
        back = np.zeros_like(pool)
        page_copy.copy(strided(back, skew + layer * page, pages, page, layers * page), dst)
        assert np.array_equal(strided(back, skew + layer * page, pages, page, layers * page), src)
        # the bytes between one layer's pages (the other layers') are left alone
        others = np.ones(back.size, dtype=bool)
        for k in range(pages):
            lo = skew + layer * page + k * layers * page
            others[lo : lo + page] = False
        assert not back[others].any()


def test_the_native_copy_refuses_what_numpy_would_not_copy_and_writes_nothing():
    assert page_copy.use(True), page_copy.EXTENSION.probe()
    native = page_copy.NATIVE.get()
    dst = np.zeros((4, 128), dtype=np.uint8)
    src = np.ones((4, 128), dtype=np.uint8)
    with pytest.raises(ValueError, match="shape"):
        native(dst, np.ones((4, 127), dtype=np.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        native(dst, np.ones((4, 256), dtype=np.uint8)[:, ::2])
    with pytest.raises(ValueError, match="overlap"):
        native(dst, dst)
    pool = np.zeros(1024, dtype=np.uint8)
    with pytest.raises(ValueError, match="overlap"):  # two views of one pool that share bytes
        native(strided(pool, 0, 4, 128, 256), strided(pool, 64, 4, 128, 256))
    with pytest.raises(ValueError, match="byte"):
        native(np.zeros((4, 32), dtype=np.float32), np.zeros((4, 32), dtype=np.float32))
    read_only = np.zeros((4, 128), dtype=np.uint8)
    read_only.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        native(read_only, src)
    assert not dst.any() and not pool.any() and not read_only.any()
    assert native(dst, src) == dst.nbytes and dst.all()


def test_overlapping_views_are_copied_as_numpy_copies_them(copy_mode):
    pool = np.arange(8 * 70000, dtype=np.int64).view(np.uint8)[: 6 * 70000].copy()
    expected = pool.copy()
    np.copyto(expected[70000 : 5 * 70000].reshape(2, -1), expected[: 4 * 70000].reshape(2, -1))
    page_copy.copy(pool[70000 : 5 * 70000].reshape(2, -1), pool[: 4 * 70000].reshape(2, -1))
    assert np.array_equal(pool, expected)


def test_switched_off_it_is_never_built(monkeypatch):
    monkeypatch.setenv("PEGAFLOW_TEST_NATIVE_OFF", "0")
    log = logging.getLogger("test")
    off = OptionalNative(page_copy.EXTENSION, "copy_pages", "PEGAFLOW_TEST_NATIVE_OFF", "numpy", log)
    off.start()
    assert not off.wait_until_ready(0.3)
    assert off.get() is None
