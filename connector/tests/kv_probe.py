"""PegaKVConnector plus a recorder of each TP rank's KV bytes, for the end-to-end tests.

vLLM loads it exactly like the real connector (every hook is PegaKVConnector's own); after
each step a worker also writes down what its KV tensors hold for the blocks that step
computed or loaded, so a test can compare TP ranks byte for byte, which token outputs
cannot do (a wrong RoPE rotation or a rank-specific byte is invisible in logprobs):

    --kv-transfer-config '{"kv_connector": "ProbedPegaKVConnector",
                           "kv_connector_module_path": "pegaflow.connector.tests.kv_probe", ...}'
    env PEGAFLOW_KV_PROBE_DIR=<dir>

Per worker (TP rank r), under <dir>:
  rank<r>.jsonl         one line per block and event: {"event": "computed" | "loaded", "req",
                        "block_id", "hash" (vLLM's block hash, hex), "sha256" (of every
                        layer's page, layer after layer)}; "computed" = a full block this
                        step finished (the blocks the connector is asked to save, whether or
                        not this rank writes them), "loaded" = a block this step loaded
  stats_rank<r>.json    the worker connector's counters (saved_blocks, ...), rewritten
                        every step
  layer0/<hash>.rank<r>.bin
                        layer 0's page of every computed block (a RoPE check against the
                        model's weights)
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any

import torch

from pegaflow.connector.connector import PegaKVConnector
from pegaflow.connector.metadata import PegaConnectorMetadata

PROBE_DIR_ENV = "PEGAFLOW_KV_PROBE_DIR"


class ProbedPegaKVConnector(PegaKVConnector):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._probe_dir = pathlib.Path(os.environ[PROBE_DIR_ENV])
        self._kv: dict[str, Any] = {}
        self._rank = -1

    def register_kv_caches(self, kv_caches: dict[str, Any]):
        super().register_kv_caches(kv_caches)
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._kv = dict(kv_caches)
        self._rank = get_tensor_model_parallel_rank()
        (self._probe_dir / "layer0").mkdir(parents=True, exist_ok=True)

    def wait_for_save(self):
        super().wait_for_save()
        meta = self._get_connector_metadata()
        if isinstance(meta, PegaConnectorMetadata) and self._kv:
            self._record(meta)

    def _page_bytes(self, layer: str, block_id: int) -> bytes:
        return self._kv[layer][block_id].contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    def _record(self, meta: PegaConnectorMetadata) -> None:
        lines = []
        layers = list(self._kv)
        for event, transfers in (("loaded", meta.loads), ("computed", meta.saves)):
            for t in transfers:
                for block_id, block_hash in zip(t.block_ids, t.block_hashes, strict=True):
                    digest = hashlib.sha256()
                    for layer in layers:
                        digest.update(self._page_bytes(layer, block_id))
                    lines.append(
                        json.dumps(
                            {
                                "event": event,
                                "req": t.req_id,
                                "block_id": block_id,
                                "hash": block_hash.hex(),
                                "sha256": digest.hexdigest(),
                            }
                        )
                    )
                    if event == "computed":
                        path = self._probe_dir / "layer0" / f"{block_hash.hex()}.rank{self._rank}.bin"
                        path.write_bytes(self._page_bytes(layers[0], block_id))
        if lines:
            with open(self._probe_dir / f"rank{self._rank}.jsonl", "a") as f:
                f.write("\n".join(lines) + "\n")
        stats = dict(self._worker.stats) if self._worker is not None else {}
        tmp = self._probe_dir / f".stats_rank{self._rank}.json.tmp"
        tmp.write_text(json.dumps(stats))
        tmp.replace(self._probe_dir / f"stats_rank{self._rank}.json")
