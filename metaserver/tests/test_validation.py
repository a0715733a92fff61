"""Request field checks shared by the metaserver and its client."""

import pytest

from pegaflow.metaserver import validation as check


@pytest.mark.parametrize("value", ["a", "node-1.example:50055", "x" * 128])
def test_good_node_ids(value):
    assert check.node_id(value) == value


@pytest.mark.parametrize("value", ["", "x" * 129, " lead", "trail ", "tab\tin", "new\nline"])
def test_bad_node_ids(value):
    with pytest.raises(check.InvalidRequest, match="node_id"):
        check.node_id(value)


@pytest.mark.parametrize("value", ["h:1", "10.0.0.1:50055", "[::1]:50055", "node.example.com:65535"])
def test_good_addresses(value):
    assert check.address(value) == value


@pytest.mark.parametrize("value", ["", "h", ":50055", "h:", "h:0", "h:65536", "h:port", "h:-1"])
def test_bad_addresses(value):
    with pytest.raises(check.InvalidRequest, match="address"):
        check.address(value)


def test_hash_lists():
    assert check.block_hashes([b"a", b"b" * 64], "f") == [b"a", b"b" * 64]
    with pytest.raises(check.InvalidRequest, match=r"f\[1\]"):
        check.block_hashes([b"a", b""], "f")
    with pytest.raises(check.InvalidRequest, match=r"f\[0\]"):
        check.block_hashes([b"c" * 65], "f")
    with pytest.raises(check.InvalidRequest, match="more than 3"):
        check.block_hashes([b"a"] * 4, "f", limit=3)


def test_lease_ttl_clamping():
    assert check.lease_ttl_ms(0, 1.0, 300.0, 10.0) == 10.0
    assert check.lease_ttl_ms(500, 1.0, 300.0, 10.0) == 1.0
    assert check.lease_ttl_ms(5000, 1.0, 300.0, 10.0) == 5.0
    assert check.lease_ttl_ms(10**9, 1.0, 300.0, 10.0) == 300.0
