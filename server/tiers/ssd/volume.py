"""The tier's files: resolving the paths, the construction-time checks, preallocation, the
manifest decision (recover or re-initialise) and the address arithmetic.

Geometry. ``n`` paths give ``n`` *lanes*, one preallocated file each. The capacity is split
evenly and rounded down to whole segments: ``segments_per_lane = capacity // (n * segment)``.
A lane file is ``segments_per_lane`` segments followed by one 4 KiB lane label. Segments are
numbered globally so that consecutive numbers alternate lanes (``g = local * n + lane``), and an
extent's address is ``g * segment_bytes + offset in segment``: one flat address space whose
neighbouring segments are on different disks.

Start-up decision. All lanes' manifests must exist, check out, carry one volume id and describe
exactly the layout the options ask for; then the files are recovered (the tier's ``recover``).
Anything else (first start, other capacity, paths, segment size or format, a missing or damaged
manifest) re-initialises: one log line with the reason, old manifests removed, each file
truncated to zero and preallocated again, so no byte of the old layout can ever be read back
(fallocated space reads as zeros), a new random volume id, manifests written last.

Construction-time refusals raise SsdConfigError with the path and the reason: a path whose
folder does not exist, a file that cannot be opened or written with O_DIRECT (the lane label
write/read is the probe), a capacity the file systems cannot hold (statvfs, per file system,
counting what our files already own), the same file named twice.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets

from pegaflow.server.tiers.ssd import manifest as manifest_mod
from pegaflow.server.tiers.ssd.config import SsdConfigError, SsdTierOptions
from pegaflow.server.tiers.ssd.engines.base import aligned_buffer
from pegaflow.server.tiers.ssd.segment_format import BLOCK, FormatError, LaneLabel

log = logging.getLogger(__name__)

DATA_FILE = "pegaflow-ssd.data"


class LaneState:
    OK = "ok"
    READ_ONLY = "read-only"  # writes failed for lack of space: existing records still served
    OFF = "off"


@dataclasses.dataclass
class Lane:
    index: int
    path: str  # the data file
    fd: int
    file_bytes: int
    inode: tuple[int, int]  # (st_dev, st_ino) at open: a different one later = file replaced/removed
    state: str = LaneState.OK
    reason: str = ""


def resolve_path(path: str) -> str:
    """The data file a --ssd-cache-path names: itself, or ``<dir>/pegaflow-ssd.data`` for a folder."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return os.path.join(path, DATA_FILE)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise SsdConfigError(f"SSD cache path {path}: folder {parent} does not exist")
    if os.path.exists(path) and not os.path.isfile(path):
        raise SsdConfigError(f"SSD cache path {path} is neither a regular file nor a folder")
    return path


class Volume:
    """The open lane files of one tier and their layout (see the module docstring)."""

    def __init__(self, options: SsdTierOptions):
        options.validate()
        self.options = options
        self.segment_bytes = options.segment_bytes
        files = [resolve_path(p) for p in options.paths]
        real = [os.path.realpath(f) for f in files]
        if len(set(real)) != len(real):
            raise SsdConfigError(f"SSD cache paths name the same file twice: {', '.join(files)}")
        self.lane_count = len(files)
        self.segments_per_lane = options.capacity_bytes // (self.lane_count * self.segment_bytes)
        self.file_bytes = self.segments_per_lane * self.segment_bytes + BLOCK
        self.capacity_bytes = self.segments_per_lane * self.segment_bytes * self.lane_count
        self.fresh = True  # nothing to recover (set False when the manifests match)
        self.reinit_reason = ""
        self.lanes: list[Lane] = []
        try:
            self._open(files)
        except BaseException:
            self.close()
            raise

    # -- addresses ------------------------------------------------------------------------

    @property
    def segment_count(self) -> int:
        return self.segments_per_lane * self.lane_count

    def segment_lane(self, g: int) -> tuple[int, int]:
        """(lane, index in lane) of global segment ``g``."""
        return g % self.lane_count, g // self.lane_count

    def segment_file_offset(self, g: int) -> int:
        return (g // self.lane_count) * self.segment_bytes

    def where(self, g: int, offset: int) -> str:
        """Human-readable location for logs and recovery reports."""
        lane = self.lanes[g % self.lane_count]
        return f"{lane.path}+{self.segment_file_offset(g) + offset} (segment {g}, offset {offset})"

    # -- opening --------------------------------------------------------------------------

    def _open(self, files: list[str]) -> None:
        for i, path in enumerate(files):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
            except OSError as e:
                hint = " (the file system does not support O_DIRECT)" if e.errno == errno.EINVAL else ""
                raise SsdConfigError(
                    f"SSD cache path {path} cannot be opened for O_DIRECT writing: {e.strerror}{hint}"
                ) from e
            st = os.fstat(fd)
            self.lanes.append(Lane(i, path, fd, self.file_bytes, (st.st_dev, st.st_ino)))
        inodes = [lane.inode for lane in self.lanes]
        if len(set(inodes)) != len(inodes):
            raise SsdConfigError("SSD cache paths name the same file twice (hard links)")

        found = [manifest_mod.load(lane.path) for lane in self.lanes]
        wanted = manifest_mod.Manifest(
            volume_id=0,
            boot_epoch=0,
            segment_bytes=self.segment_bytes,
            capacity_bytes=self.options.capacity_bytes,
            segments_per_lane=self.segments_per_lane,
            lanes=tuple(lane.path for lane in self.lanes),
            lane=0,
        )
        why = self._mismatch(found, wanted)
        if why is None:
            self.fresh = False
            self.volume_id = found[0].volume_id
            self.boot_epoch = max(m.boot_epoch for m in found) + 1
        else:
            self.reinit_reason = why
            self.volume_id = secrets.randbits(63) or 1
            self.boot_epoch = 1
        self._check_space()
        if self.fresh:
            if any(not isinstance(m, str) for m in found) or any(
                os.fstat(la.fd).st_size for la in self.lanes
            ):
                log.warning(
                    "ssd tier: re-initialising %s: %s; nothing in them is kept",
                    ", ".join(la.path for la in self.lanes),
                    why,
                )
            for lane in self.lanes:
                manifest_mod.remove(lane.path)
            for lane in self.lanes:
                self._preallocate(lane, from_zero=True)
        else:
            for lane in self.lanes:
                size = os.fstat(lane.fd).st_size
                if size < self.file_bytes:
                    log.error(
                        "ssd tier: %s is %d bytes, its layout needs %d (truncated?): extending it; "
                        "records past the cut are lost",
                        lane.path,
                        size,
                        self.file_bytes,
                    )
                    self._preallocate(lane, from_zero=False)
        for lane in self.lanes:
            self._write_label(lane)
        for lane in self.lanes:
            m = dataclasses.replace(
                wanted, volume_id=self.volume_id, boot_epoch=self.boot_epoch, lane=lane.index
            )
            try:
                manifest_mod.store(lane.path, m)
            except OSError as e:
                raise SsdConfigError(f"cannot write the manifest of {lane.path}: {e.strerror}") from e

    def _mismatch(self, found: list, wanted: manifest_mod.Manifest) -> str | None:
        for lane, m in zip(self.lanes, found, strict=True):
            if isinstance(m, str):
                return m
            diff = m.same_layout(wanted)
            if diff:
                return f"{manifest_mod.path_for(lane.path)} describes another layout ({diff})"
            if m.lane != lane.index:
                return f"{manifest_mod.path_for(lane.path)} is lane {m.lane}, now lane {lane.index}"
            if m.volume_id != found[0].volume_id:
                return "the manifests name different volumes"
        return None

    def _check_space(self) -> None:
        """Refuses a capacity the file systems cannot hold (counting blocks our files already own)."""
        need: dict[int, int] = {}
        where: dict[int, str] = {}
        for lane in self.lanes:
            st = os.fstat(lane.fd)
            owned = 0 if self.fresh else st.st_blocks * 512
            need[st.st_dev] = need.get(st.st_dev, 0) + max(0, self.file_bytes - owned)
            where.setdefault(st.st_dev, os.path.dirname(lane.path))
        for dev, nbytes in need.items():
            vfs = os.statvfs(where[dev])
            free = vfs.f_bavail * vfs.f_frsize
            if self.fresh:  # our old files are about to be truncated: their blocks come back
                free += sum(
                    os.fstat(la.fd).st_blocks * 512 for la in self.lanes if os.fstat(la.fd).st_dev == dev
                )
            if nbytes > free:
                raise SsdConfigError(
                    f"SSD capacity does not fit: the files under {where[dev]} need {nbytes} more bytes, "
                    f"the file system has {free} free ({vfs.f_blocks * vfs.f_frsize} in all); "
                    "lower --ssd-cache-capacity or add paths on other disks"
                )

    def _preallocate(self, lane: Lane, from_zero: bool) -> None:
        try:
            if from_zero:
                os.ftruncate(lane.fd, 0)
            if self.options.preallocate:
                try:
                    os.posix_fallocate(lane.fd, 0, self.file_bytes)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                        raise
                    log.warning(
                        "ssd tier: %s: no fallocate on this file system; the file is sparse", lane.path
                    )
            if os.fstat(lane.fd).st_size < self.file_bytes:
                os.ftruncate(lane.fd, self.file_bytes)
            os.fsync(lane.fd)
        except OSError as e:
            raise SsdConfigError(
                f"cannot preallocate {self.file_bytes} bytes for {lane.path}: {e.strerror}"
            ) from e

    def _write_label(self, lane: Lane) -> None:
        """Writes and reads back the lane label with O_DIRECT: the write probe of each file."""
        label = LaneLabel(self.volume_id, lane.index, self.lane_count, self.boot_epoch, self.file_bytes)
        buf = aligned_buffer(BLOCK)
        buf[:] = label.encode()
        back = aligned_buffer(BLOCK)
        offset = self.file_bytes - BLOCK
        try:
            if os.pwritev(lane.fd, [buf], offset) != BLOCK or os.preadv(lane.fd, [back], offset) != BLOCK:
                raise OSError(errno.EIO, "short O_DIRECT transfer")
        except OSError as e:
            hint = " (the file system refuses O_DIRECT I/O)" if e.errno == errno.EINVAL else ""
            raise SsdConfigError(
                f"SSD cache path {lane.path}: O_DIRECT write failed: {e.strerror}{hint}"
            ) from e
        try:
            if LaneLabel.decode(back) != label:
                raise FormatError("read back differently")
        except FormatError as e:
            raise SsdConfigError(f"SSD cache path {lane.path}: O_DIRECT write did not read back ({e})") from e

    def close(self) -> None:
        for lane in self.lanes:
            if lane.fd >= 0:
                try:
                    os.close(lane.fd)
                except OSError:
                    pass
                lane.fd = -1
