"""pegaflow-server's command line: strict sizes, refusals with clear messages, no dead flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pegaflow.server.config import GIB, MIB, TIB, parse_duration, parse_size, parse_windows
from pegaflow.server.errors import PoolCapacityError
from pegaflow.server.main import build_parser, config_from_args
from pegaflow.server.tiers.dram.region import check_capacity, read_meminfo


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m pegaflow.server ARGS``, on free ports unless ARGS name others (the last flag wins):
    a server that starts by mistake must not take the default ports."""
    if "--help" not in args:
        args = ("--addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", *args)
    return subprocess.run(
        [sys.executable, "-m", "pegaflow.server", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512mb", 512 * MIB),
        ("30gb", 30 * GIB),
        ("1tb", TIB),
        ("1.5GiB", 3 * GIB // 2),
        ("4096b", 4096),
        ("2 MB", 2 * MIB),
    ],
)
def test_parse_size_accepts_the_documented_forms(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "gb", "12xb", "-5gb", "0", "0gb", "1.5", "3e9", "ten gb", "1gb2", "0.1b", "4096"]
)
def test_parse_size_rejects_anything_else(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_windows_and_durations():
    assert parse_windows("15m,1h,24h") == {"15m": 900.0, "1h": 3600.0, "24h": 86400.0}
    assert parse_duration("250ms") == 0.25
    for bad in ("15", "1h,1h", "1x", "", "1h,,2h", "0m"):
        with pytest.raises(ValueError):
            parse_windows(bad)


def test_python_dash_m_runs_the_cli():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: pegaflow-server") and "--pool-size" in proc.stdout


def test_help_documents_every_flag_including_the_tiers():
    help_text = build_parser().format_help()
    for flag in (
        "--addr",
        "--pool-size",
        "--use-hugepages",
        "--http-addr",
        "--enable-lfu-admission",
        "--metric-hll-windows",
        "--log-level",
        "--persist-pool",
        "--ssd-cache-path",
        "--ssd-cache-capacity",
        "--ssd-write-policy",
        "--ssd-io-engine",
        "--promote-inflight",
        "--ssd-yield-ms",
        "--ssd-yield-depth",
        "--tenant-file",
    ):
        assert flag in help_text


def test_the_seeds_ssd_command_parses_and_several_paths_stripe(tmp_path):
    args = build_parser().parse_args(
        [
            "--pool-size",
            "30gb",
            "--ssd-cache-path",
            "/a",
            "--ssd-cache-path",
            "/b",
            "--ssd-cache-capacity",
            "512gb",
        ]
    )
    config = config_from_args(args)
    assert config.ssd_cache_paths == ("/a", "/b") and config.ssd_cache_capacity_bytes == 512 << 30


def test_the_ssd_yield_defaults_on_and_bad_values_are_refused():
    base = ["--pool-size", "64mb", "--ssd-cache-path", "/a", "--ssd-cache-capacity", "1gb"]
    config = config_from_args(build_parser().parse_args(base))
    assert (config.ssd_yield_s, config.ssd_yield_depth) == (0.03, 2)
    off = config_from_args(build_parser().parse_args([*base, "--ssd-yield-ms", "0"]))
    assert off.ssd_yield_s == 0
    for bad in (["--ssd-yield-ms", "-1"], ["--ssd-yield-ms", "5000"], ["--ssd-yield-depth", "0"]):
        with pytest.raises(ValueError, match="ssd-yield"):
            config_from_args(build_parser().parse_args([*base, *bad]))


def test_an_ssd_path_without_a_capacity_or_an_unopenable_one_is_refused(tmp_path):
    proc = run_cli("--pool-size", "64mb", "--ssd-cache-path", str(tmp_path))
    assert proc.returncode == 2 and "--ssd-cache-capacity is required" in proc.stderr
    proc = run_cli(
        "--pool-size", "64mb", "--addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
        "--ssd-cache-path", str(tmp_path / "no" / "such" / "dir" / "file"), "--ssd-cache-capacity", "1gb",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_an_ssd_capacity_the_file_system_cannot_hold_is_refused(tmp_path):
    proc = run_cli(
        "--pool-size", "64mb", "--addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
        "--ssd-cache-path", str(tmp_path), "--ssd-cache-capacity", "1000tb",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_cli_rejects_malformed_sizes_and_a_pool_below_one_slab():
    proc = run_cli("--pool-size", "12xb")
    assert proc.returncode == 2
    assert "unknown unit" in proc.stderr
    proc = run_cli("--pool-size", "1mb", "--addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0")
    assert proc.returncode == 2
    assert "the pool must be at least 4.00 MiB" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_refuses_a_pool_this_machine_cannot_back():
    available = read_meminfo()["MemAvailable"]
    too_big = f"{(available >> 30) + 64}gb"
    proc = run_cli("--pool-size", too_big, "--addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0")
    assert proc.returncode == 2, proc.stderr
    assert "cannot be backed by this machine" in proc.stderr and "MemAvailable" in proc.stderr
    assert proc.stdout == ""  # never reported ready


def test_cli_refuses_hugepages_without_a_reservation():
    if read_meminfo().get("HugePages_Total", 0):
        pytest.skip("this machine has huge pages reserved")
    proc = run_cli(
        "--pool-size", "64mb", "--use-hugepages", "--addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"
    )
    assert proc.returncode == 2, proc.stderr
    assert "no huge pages are reserved" in proc.stderr and "nr_hugepages" in proc.stderr


def test_capacity_check_with_hugepages_reserved_but_too_few():
    meminfo = {"HugePages_Total": 16, "HugePages_Free": 16, "HugePages_Rsvd": 4, "Hugepagesize": 2 * MIB}
    check_capacity(24 * MIB, use_hugepages=True, meminfo=meminfo)
    with pytest.raises(PoolCapacityError, match="does not fit in the free huge pages"):
        check_capacity(26 * MIB, use_hugepages=True, meminfo=meminfo)


def test_cli_refuses_a_port_in_use_instead_of_sharing_it(tmp_path):
    from pegaflow.server.testing import ServerProcess

    with ServerProcess(tmp_path, pool_size="16mb", http_addr=None) as first:
        proc = run_cli("--pool-size", "16mb", "--addr", first.addr, "--http-addr", "127.0.0.1:0")
        assert proc.returncode == 1, proc.stderr
        assert f"cannot listen for gRPC on {first.addr}" in proc.stderr
        assert first.alive()


def test_host_port_parsing_round_trips_ipv4_and_ipv6():
    from pegaflow.common.addresses import format_host_port
    from pegaflow.server.config import parse_host_port

    for text in ("127.0.0.1:50055", "[::1]:0", "0.0.0.0:9091", "node-a:50055"):
        assert format_host_port(*parse_host_port(text)) == text
    for bad in ("50055", "host:", ":80", "host:99999", "::1:80"):
        with pytest.raises(ValueError):
            parse_host_port(bad)


def test_pool_dir_must_be_a_memory_filesystem_and_works_on_tmpfs(tmp_path):
    import os

    from pegaflow.client import KvLayout, PegaClient
    from pegaflow.server.testing import ServerProcess
    from pegaflow.server.tiers.dram.region import _mount_fstype

    if _mount_fstype(str(tmp_path)) not in ("tmpfs", "hugetlbfs"):
        proc = run_cli("--pool-size", "16mb", "--pool-dir", str(tmp_path), "--addr", "127.0.0.1:0")
        assert proc.returncode == 2, proc.stderr
        assert "must be a tmpfs" in proc.stderr
    proc = run_cli("--pool-size", "16mb", "--pool-dir", "/dev/shm", "--use-hugepages")
    assert proc.returncode == 2 and "exclude each other" in proc.stderr
    if not os.path.isdir("/dev/shm") or _mount_fstype("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    with ServerProcess(
        tmp_path / "srv", pool_size="16mb", http_addr=None, extra_args=["--pool-dir", "/dev/shm"]
    ) as srv:
        mine = f".pegaflow-pool-{srv.proc.pid}-"
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(mine)]  # unlinked at once
        with PegaClient(srv.addr, timeout_s=10.0) as c:
            inst = c.register_instance(KvLayout(model_id="m", block_bytes=4096))
            batch = c.allocate(inst, [b"a"])
            c.pool_view(batch.epoch)[batch.allocations[0].offset] = 7
            c.seal(batch.save_id)
            hit = c.query_prefix(inst, [b"a"], lease=True)
            assert c.pool_view(hit.epoch)[hit.locations[0].offset] == 7
            c.release(hit.lease_id)
