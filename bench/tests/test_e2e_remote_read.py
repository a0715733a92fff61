"""`bazel test //bench:remote_read`: the reduced remote-read regression, two pegaflow nodes in real
network namespaces (bench/experiments/remote_read.py, `--regression`), run once for both tests.

- Node B pulls prefixes node A holds through the servers: every pull must bring the whole prefix,
  every block byte-identical to what A's client saved.
- vLLM on node B serves prompts vLLM on node A computed: B's first request must load the prompt from
  A's blocks and generate exactly A's tokens. Skipped, with the reason, while PegaKVConnector does
  not wait for blocks its server is still finding or pulling (then a remote hit cannot reach vLLM's
  first lookup: see remote_read.connector_waits).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest

from pegaflow.bench.experiments import remote_read
from pegaflow.common.testing.netns import require_netns

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def regression(tmp_path_factory):
    require_netns()
    out = tmp_path_factory.mktemp("remote-read")
    # vLLM's IPC sockets live under the work dir (107-byte Unix socket paths): a short one
    work = tempfile.mkdtemp(prefix="rr-", dir=os.environ.get("TEST_TMPDIR"))
    try:
        rc = remote_read.main(["--regression", "--workdir", work, "--out", str(out)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = json.loads((out / "remote_read_regression.json").read_text())
    return rc, report, out


def test_node_b_pulls_what_node_a_holds_whole_and_byte_identical(regression):
    rc, report, out = regression
    assert rc == 0, report["regression"]["problems"]
    for raw in report["pulls"]["by_streams"].values():
        stats = raw["stats"]
        assert stats["pulls"] >= 2
        assert stats["complete"] == stats["verified"] == stats["pulls"] and stats["wrong_blocks"] == 0
        for r in raw["rounds"]:
            for pull in r["pulls"]:
                # B missed locally, found the prefix through the metaserver and pulled every block of it
                assert pull["first"]["hits"] == 0 and pull["first"]["searching"]
                assert pull["pulled_bytes"] == raw["pools"]["b"]
        assert raw["server_stats"]["b"]["fetched_blocks"] == stats["pulls"] * raw["blocks_per_pull"]
    assert (out / "remote_read_regression.png").stat().st_size > 0


def test_vllm_on_node_b_serves_node_a_s_prompt_from_a_remote_hit(regression):
    rc, report, _ = regression
    ttft = report["ttft"]
    if ttft.get("skipped"):
        pytest.skip(ttft["skipped"])
    assert rc == 0, report["regression"]["problems"]
    per = report["ttft_per_prompt"]
    assert per["remote_hit_used"] and per["tokens_identical"], per
    assert per["b_fetched_blocks_during_remote"] >= len(per["per_prompt"]) * (
        per["loadable_tokens"] // remote_read.models.CPU_BLOCK_TOKENS
    )
