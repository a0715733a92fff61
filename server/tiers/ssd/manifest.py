"""The manifest: one small file next to each lane file (``<data file>.manifest``) that says what
layout the data files hold, so a start knows whether it may recover them.

JSON (an operator can read it) with an XXH3-64 checksum over the canonical encoding of its body,
written atomically: a temporary file in the same folder, fsync, rename over the old one, fsync of
the folder. A torn or half-written manifest therefore never exists under the real name.

Every lane's manifest holds the whole layout (all lanes' files in order, segment size, requested
capacity, format version, volume id) plus its own lane number and the boot epoch. The boot
epoch goes up by one at every start that recovers, before anything is written: generations and
sequence numbers of this run start at ``boot_epoch << 32`` / ``<< 40``, so they are above every
number an earlier run can have put on disk, even one recovery never saw.
"""

from __future__ import annotations

import dataclasses
import json
import os

from pegaflow.common.wire.checksum import checksum

FORMAT = 1
SUFFIX = ".manifest"


@dataclasses.dataclass(frozen=True)
class Manifest:
    volume_id: int
    boot_epoch: int
    segment_bytes: int
    capacity_bytes: int  # as requested (the flag); the layout uses whole segments of it
    segments_per_lane: int
    lanes: tuple[str, ...]  # the lane files, in order
    lane: int  # which of them this manifest sits beside
    format: int = FORMAT

    def body(self) -> dict:
        d = dataclasses.asdict(self)
        d["lanes"] = list(self.lanes)
        return d

    def same_layout(self, other: Manifest) -> str | None:
        """None when both describe the same layout; else what differs."""
        for field in ("format", "segment_bytes", "capacity_bytes", "segments_per_lane", "lanes"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"{field} {theirs!r} on disk, {mine!r} now"
        return None


def path_for(data_file: str) -> str:
    return data_file + SUFFIX


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def load(data_file: str) -> Manifest | str:
    """The manifest beside ``data_file``, or a string saying why there is no usable one."""
    path = path_for(data_file)
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except FileNotFoundError:
        return f"no manifest at {path}"
    except OSError as e:
        return f"cannot read {path}: {e.strerror}"
    try:
        doc = json.loads(raw)
        body = doc["body"]
        if doc.get("xxh3") != f"{checksum(_canonical(body)):016x}":
            return f"manifest {path} checksum mismatch"
        if body.get("format") != FORMAT:
            return f"manifest {path} has format {body.get('format')}, this build reads {FORMAT}"
        body["lanes"] = tuple(body["lanes"])
        return Manifest(**body)
    except (ValueError, KeyError, TypeError) as e:
        return f"manifest {path} is unreadable ({e})"


def store(data_file: str, manifest: Manifest) -> None:
    """Atomically replaces the manifest beside ``data_file`` (raises OSError)."""
    path = path_for(data_file)
    folder = os.path.dirname(path) or "."
    body = manifest.body()
    doc = {"body": body, "xxh3": f"{checksum(_canonical(body)):016x}"}
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    sync_dir(folder)


def remove(data_file: str) -> None:
    path = path_for(data_file)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    sync_dir(os.path.dirname(path) or ".")


def sync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
