"""L2 end to end: pegaflow-server nodes in real network namespaces on one switch, a real
pegaflow-metaserver, real clients inside the namespaces, processes killed for real.

- node B misses a prefix node A computed, finds it through the metaserver and pulls it: the
  blocks arrive byte-identical and are served as hits from REMOTE;
- the metaserver is killed and restarted: nodes re-publish what they hold, pulls work again;
- a stale index entry (the holder evicted the blocks) is a miss, never an error;
- the holder is SIGKILLed: a pull of its blocks is a miss by the deadline, nothing half-written
  becomes visible, and the requester keeps serving;
- three nodes: what B pulled from A, B holds and publishes; with A dead, C pulls it from B.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

from pegaflow.common.testing.netns import NetnsLab, require_netns
from pegaflow.metaserver.testing import MetaServerProcess
from pegaflow.server.testing import ServerProcess, wait_for

pytestmark = pytest.mark.timeout(300)

WORKER = pathlib.Path(__file__).with_name("client_worker.py")
LAYOUT = dict(
    model_id="two-nodes", model_fingerprint="f", dtype="bf16", layout="t", block_tokens=16,
    block_bytes=512 * 1024, num_layers=2, tp_size=1, tp_rank=0, mla=False, extra="",
)  # fmt: skip


def hexes(tag: str, n: int) -> list[str]:
    return [f"{tag}-{i:04d}".encode().hex() for i in range(n)]


def worker(node, addr: str, action: str, hashes: list[str], tag: str, **extra) -> dict:
    spec = dict(addr=addr, action=action, hashes=hashes, tag=tag, layout=LAYOUT, **extra)
    out = node.run([sys.executable, str(WORKER), json.dumps(spec)], timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def cluster(tmp_path):
    yield from _nodes(tmp_path, ("a", "b"))


@pytest.fixture
def trio(tmp_path):
    yield from _nodes(tmp_path, ("a", "b", "c"))


def _nodes(tmp_path, names):
    """pegaflow-server nodes (one network namespace each) and a metaserver in namespace m, on one
    switch."""
    require_netns()
    with NetnsLab() as lab:
        hosts = {name: lab.add_node(name) for name in names}
        m = lab.add_node("m")
        switch = lab.switch([*hosts.values(), m])
        meta = MetaServerProcess(tmp_path / "meta", host=m.addr, launcher=m.command([])).start()

        def node(n, name) -> ServerProcess:
            return ServerProcess(
                tmp_path / name,
                pool_size="64mb",
                addr=f"{n.addr}:{50055}",
                http_addr=f"{n.addr}:0",
                launcher=n.command([]),
                extra_args=["--metaserver-addr", meta.addr, "--peer-fetch-deadline", "3"],
            ).start()

        servers = {name: node(host, name) for name, host in hosts.items()}
        state = {"lab": lab, "switch": switch, **hosts, "m": m, "meta": meta, "servers": servers}
        try:
            yield state
        finally:
            for srv in servers.values():
                srv.stop()
            cluster_meta = state.get("meta", meta)
            cluster_meta.kill()


def published(cluster, n_keys: int) -> None:
    """Waits until the metaserver's index holds at least n_keys entries."""

    def enough() -> bool:
        out = cluster["m"].run(
            [sys.executable, "-c", f"from pegaflow.metaserver.client import MetaClient; "
             f"c = MetaClient({cluster['meta'].addr!r}); print(c.stats().entries)"],
            check=False,
        )  # fmt: skip
        return out.returncode == 0 and out.stdout.strip().isdigit() and int(out.stdout) >= n_keys

    wait_for(enough, 30, interval_s=0.2, what=f"{n_keys} keys in the metaserver")


def entries_by_address(cluster) -> dict[str, int] | None:
    """The metaserver's live nodes: {the node's advertised address: entries it holds}."""
    out = cluster["m"].run(
        [sys.executable, "-c", f"import json; from pegaflow.metaserver.client import MetaClient; "
         f"c = MetaClient({cluster['meta'].addr!r}); "
         f"print(json.dumps({{n.address: n.entries for n in c.stats().nodes}}))"],
        check=False,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None


def test_a_prefix_computed_on_one_node_is_pulled_by_another_byte_identical(cluster):
    a, b, servers = cluster["a"], cluster["b"], cluster["servers"]
    hashes = hexes("shared", 24)
    assert worker(a, servers["a"].addr, "save", hashes, "shared")["sealed"] == 24
    published(cluster, 24)
    got = worker(b, servers["b"].addr, "load-wait", hashes, "shared")
    assert got["first"]["hits"] == 0 and (got["first"]["searching"] or got["first"]["pending"])
    assert got["hits"] == 24 and got["match"], got
    # now local on B: a second lookup hits DRAM, and B publishes that it holds them too
    again = worker(b, servers["b"].addr, "load-wait", hashes, "shared")
    assert again["first"]["hits"] == 24 and again["first"]["sources"] == ["DRAM"] * 24


def test_after_a_metaserver_restart_nodes_republish_and_pulls_resume(cluster, tmp_path):
    a, b, m, servers = cluster["a"], cluster["b"], cluster["m"], cluster["servers"]
    hashes = hexes("before", 12)
    worker(a, servers["a"].addr, "save", hashes, "before")
    published(cluster, 12)
    meta = cluster["meta"]
    port = int(meta.addr.rsplit(":", 1)[1])
    meta.kill()
    restarted = MetaServerProcess(tmp_path / "meta2", host=m.addr, launcher=m.command([]), port=port).start()
    cluster["meta"] = restarted
    published(cluster, 12)  # the index is empty after the restart: this is node A re-publishing
    got = worker(b, servers["b"].addr, "load-wait", hashes, "before")
    assert got["hits"] == 12 and got["match"], got


def test_a_stale_index_entry_is_a_miss_not_an_error(cluster):
    a, b, servers = cluster["a"], cluster["b"], cluster["servers"]
    hashes = hexes("stale", 8)
    worker(a, servers["a"].addr, "save", hashes, "stale")
    published(cluster, 8)
    # A evicts them: 3 x its pool of other blocks (the removals may not have reached the index yet)
    for i in range(6):
        worker(a, servers["a"].addr, "save", hexes(f"filler{i}", 64), f"filler{i}")
    got = worker(b, servers["b"].addr, "load-wait", hashes, "stale", wait_s=10)
    assert got["hits"] == 0 and got["match"]  # nothing wrong was served


def test_a_holder_killed_mid_pull_is_a_miss_by_the_deadline_and_b_keeps_serving(cluster):
    a, b, servers = cluster["a"], cluster["b"], cluster["servers"]
    hashes = hexes("doomed", 48)
    worker(a, servers["a"].addr, "save", hashes, "doomed")
    published(cluster, 48)
    servers["a"].kill()  # SIGKILL: the pull finds a dead peer (or dies half way)
    t0 = time.monotonic()
    got = worker(b, servers["b"].addr, "load-wait", hashes, "doomed", wait_s=10)
    assert got["match"]  # whatever B serves is right (nothing half-written is visible)
    assert got["hits"] == 0
    assert time.monotonic() - t0 < 3 + 10  # bounded by the fetch deadline
    # B still serves its own blocks
    mine = hexes("mine", 4)
    worker(b, servers["b"].addr, "save", mine, "mine")
    assert worker(b, servers["b"].addr, "load", mine, "mine")["hits"] == 4


def _slow_pull(cluster, tag: str, n: int):
    """Node A holds n blocks behind a slow link; node B starts pulling them (a background worker)."""
    a, b, servers = cluster["a"], cluster["b"], cluster["servers"]
    hashes = hexes(tag, n)
    worker(a, servers["a"].addr, "save", hashes, tag)
    published(cluster, n)
    cluster["switch"].port(a).limit_rate("16mbit")  # ~2 MB/s: the pull takes seconds
    spec = dict(addr=servers["b"].addr, action="load-wait", hashes=hashes, tag=tag, layout=LAYOUT, wait_s=15)
    proc = b.popen([sys.executable, str(WORKER), json.dumps(spec)], stdout=subprocess.PIPE, text=True)
    return hashes, proc


def _result(proc) -> dict:
    out, _ = proc.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


def test_a_holder_killed_in_the_middle_of_a_pull_leaves_only_whole_blocks(cluster):
    hashes, proc = _slow_pull(cluster, "midkill", 32)
    time.sleep(1.5)  # the pull is under way (16 MiB at ~2 MB/s)
    cluster["servers"]["a"].kill()
    got = _result(proc)
    assert got["match"] and got["hits"] < len(hashes)  # the blocks that arrived whole, nothing else
    assert got["wait_s"] < 3 + 5


def test_a_partition_in_the_middle_of_a_pull_ends_it_at_its_deadline(cluster):
    hashes, proc = _slow_pull(cluster, "cut", 32)
    time.sleep(1.5)
    cluster["switch"].port(cluster["a"]).set_down()
    t0 = time.monotonic()
    got = _result(proc)
    assert got["match"] and got["hits"] < len(hashes)
    assert time.monotonic() - t0 < 3 + 5  # the fetch deadline (3 s) bounds the wait
    cluster["switch"].port(cluster["a"]).set_up()


def test_three_nodes_what_b_pulled_from_a_is_held_by_b_and_c_pulls_it_from_b_once_a_died(trio):
    servers = trio["servers"]
    hashes = hexes("relay", 16)
    assert worker(trio["a"], servers["a"].addr, "save", hashes, "relay")["sealed"] == 16
    published(trio, 16)
    got = worker(trio["b"], servers["b"].addr, "load-wait", hashes, "relay")
    assert got["hits"] == 16 and got["match"], got
    # B publishes the fetched blocks as held there too: two holders of the same 16 keys
    wait_for(
        lambda: (entries_by_address(trio) or {}).get(servers["b"].addr, 0) >= 16,
        30,
        interval_s=0.2,
        what="B publishing what it pulled",
    )
    servers["a"].kill()
    wait_for(
        lambda: servers["a"].addr not in (entries_by_address(trio) or {servers["a"].addr: 0}),
        60,
        interval_s=0.5,
        what="the dead holder's registration to expire",
    )
    got = worker(trio["c"], servers["c"].addr, "load-wait", hashes, "relay")
    assert got["first"]["hits"] == 0  # not on C: it came from B, the only holder left
    assert got["hits"] == 16 and got["match"], got
