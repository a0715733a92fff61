"""What the block store keeps on disk beside a persistent tier: the namespaces' layouts.

An SSD record names its block by tag (namespace id + hash, store/namespace.py).
The namespace id is a digest of the layout, so a restarted server maps records
to the same namespaces; the layouts themselves are saved here so that the
namespaces exist (with their model names, block sizes) before any engine
registers again. One small JSON file, written atomically (temp file, fsync,
rename, fsync of the directory) and checksummed like every byte format that
touches disk: a file that fails its checksum is ignored with one log line
(its records are then orphans, freed at recovery), never trusted.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Sequence

from pegaflow.common.wire.checksum import checksum
from pegaflow.server.store.namespace import NamespaceTable, parse_block_tag

log = logging.getLogger(__name__)

FILE_NAME = "pegaflow-namespaces.json"
FORMAT = 1


def state_dir(ssd_paths: Sequence[str]) -> str:
    """Where the store's state lives: the first SSD path if it is a directory, else its directory."""
    first = ssd_paths[0]
    return first if os.path.isdir(first) else os.path.dirname(os.path.abspath(first))


def save_namespaces(directory: str, layouts: dict[str, dict]) -> None:
    body = json.dumps({"format": FORMAT, "namespaces": layouts}, sort_keys=True)
    doc = json.dumps({"checksum": checksum(body.encode()), "body": body})
    path = pathlib.Path(directory) / FILE_NAME
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(doc)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # the previous file stays whole; a half-written one never lands
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_namespaces(directory: str) -> dict[str, dict]:
    path = pathlib.Path(directory) / FILE_NAME
    try:
        doc = json.loads(path.read_text())
        body = doc["body"]
        if checksum(body.encode()) != doc["checksum"]:
            raise ValueError("checksum mismatch")
        parsed = json.loads(body)
        if parsed.get("format") != FORMAT:
            raise ValueError(f"format {parsed.get('format')!r}, expected {FORMAT}")
        return dict(parsed["namespaces"])
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s ignored (%s): blocks of its namespaces are not recovered", path, exc)
        return {}


def namespace_of(namespaces: NamespaceTable, tag: bytes) -> tuple[int, bytes] | None:
    """(namespace index, block hash) of a recovered record's tag; None for an unknown namespace."""
    try:
        ns_id, block_hash = parse_block_tag(tag)
    except ValueError:
        return None
    ns = namespaces.by_id(ns_id)
    return None if ns is None else (ns.index, block_hash)
