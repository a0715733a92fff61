"""The shared-memory region that holds every cached KV byte on this host.

One memfd (hugetlb-backed with ``use_hugepages``), sized and pre-faulted at
start so that the memory is really there: ``posix_fallocate`` makes the kernel
allocate every page now (failing loudly instead of an OOM or SIGBUS later) and
``MAP_POPULATE`` fills the page tables. Local clients map the same memfd, passed
to them by ``fd_broker``; the server itself maps it too, which is what a later
GPU path needs (the server registers this mapping with cudaHostRegister and
copies between it and the workers' CUDA IPC buffers itself).

Sealed size (issue 12 F1): every client gets the pool's fd read-write, so before the fd is ever
passed the memfd (plain or hugetlb) is sealed with F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL: a
client's ftruncate / growing fallocate gets EPERM, so no client can make another's mapping fault
(SIGBUS) or the pool's blocks read as zeros, and nobody can lift the seals. Seals do not stop a
writer from writing bytes (or punching holes, which reads back as zeros): what a client may
write is the trust model's question, answered by block checksums, not by the fd. A file under
``--pool-dir`` cannot be sealed (Linux seals memfds only; tmpfs and hugetlbfs files refuse with
EPERM, measured on kernel 6.18): the server then logs a warning at start, and ``sealed`` is
False. Use that backing only where every user who can reach the fd socket (mode 0660: the
server's user and group) is trusted with the pool's size.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import logging
import mmap
import os
import pathlib
import time
from collections.abc import Sequence

from pegaflow.server.config import MIB, format_size
from pegaflow.server.errors import PoolCapacityError

log = logging.getLogger(__name__)

HUGEPAGE_BYTES = 2 * MIB
# Memory the server process itself (Python, gRPC, index) needs besides the pool.
PROCESS_HEADROOM_BYTES = 256 * MIB


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes (page counts such as HugePages_Free stay counts)."""
    info: dict[str, int] = {}
    for line in pathlib.Path(path).read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        value = int(parts[0])
        info[name] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
    return info


def _cgroup_memory_room() -> int | None:
    """Bytes left under this process's cgroup v2 memory limit, or None when unlimited/unknown."""
    try:
        rel = pathlib.Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        base = pathlib.Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((base / "memory.current").read_text().strip())
    except (OSError, IndexError, ValueError):
        return None


def check_capacity(size_bytes: int, use_hugepages: bool, meminfo: dict[str, int] | None = None) -> None:
    """Refuse, with a message an operator can act on, a pool this machine cannot back."""
    info = meminfo if meminfo is not None else read_meminfo()
    if use_hugepages:
        page = info.get("Hugepagesize", HUGEPAGE_BYTES)
        total = info.get("HugePages_Total", 0)
        usable = (info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)) * page
        if total == 0:
            raise PoolCapacityError(
                "--use-hugepages: no huge pages are reserved on this machine (HugePages_Total is 0). "
                f"Reserve at least {-(-size_bytes // page)} pages of {format_size(page)}, e.g. "
                f"`echo {-(-size_bytes // page)} > /proc/sys/vm/nr_hugepages`, or drop --use-hugepages."
            )
        if size_bytes > usable:
            raise PoolCapacityError(
                f"--pool-size {format_size(size_bytes)} does not fit in the free huge pages "
                f"({format_size(max(usable, 0))} free of {total} x {format_size(page)} reserved). "
                "Reserve more pages (/proc/sys/vm/nr_hugepages) or lower --pool-size."
            )
        return
    available = info.get("MemAvailable", 0)
    room = available - PROCESS_HEADROOM_BYTES
    if size_bytes > room:
        raise PoolCapacityError(
            f"--pool-size {format_size(size_bytes)} cannot be backed by this machine: "
            f"MemAvailable is {format_size(available)} and the server needs "
            f"{format_size(PROCESS_HEADROOM_BYTES)} besides the pool. Lower --pool-size."
        )
    cgroup_room = _cgroup_memory_room()
    if cgroup_room is not None and size_bytes + PROCESS_HEADROOM_BYTES > cgroup_room:
        raise PoolCapacityError(
            f"--pool-size {format_size(size_bytes)} exceeds this cgroup's memory limit "
            f"({format_size(max(cgroup_room, 0))} left under memory.max). Lower --pool-size."
        )


POOL_DIR_FILESYSTEMS = ("tmpfs", "hugetlbfs")
# The pool's size is fixed for its life; F_SEAL_SEAL: nobody may change the seals afterwards.
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def seal_size(fd: int) -> bool:
    """Seals ``fd`` against shrinking and growing; False when its file cannot be sealed."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
    except OSError:
        return False
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SIZE_SEALS == SIZE_SEALS


def _mount_fstype(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (longest matching mount point)."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    for line in pathlib.Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, fstype = point, parts[2]
    return fstype


def _check_pool_dir(pool_dir: str) -> str:
    if not os.path.isdir(pool_dir):
        raise PoolCapacityError(f"--pool-dir {pool_dir} is not a directory")
    fstype = _mount_fstype(pool_dir)
    if fstype not in POOL_DIR_FILESYSTEMS:
        raise PoolCapacityError(
            f"--pool-dir {pool_dir} is on {fstype or 'an unknown filesystem'}; it must be a tmpfs "
            "(e.g. `mount -t tmpfs -o huge=always,size=32g tmpfs DIR`) or a hugetlbfs mount, "
            "so that the pool stays in memory"
        )
    return fstype


def _check_dir_room(pool_dir: str, size_bytes: int) -> None:
    st = os.statvfs(pool_dir)
    room = st.f_bavail * st.f_frsize
    if size_bytes > room:
        raise PoolCapacityError(
            f"--pool-size {format_size(size_bytes)} does not fit in --pool-dir {pool_dir} "
            f"({format_size(room)} free on that mount). Lower --pool-size or enlarge the mount."
        )


POOL_FILE = "pegaflow-pool.data"
LOCK_FILE = "pegaflow-pool.lock"


def _open_persistent(pool_dir: str, size_bytes: int) -> tuple[int, int, bool]:
    """(pool fd, lock fd, whether the file already held a pool of this size): the named pool file of
    a persistent pool, which outlives this process so the next server re-adopts its blocks
    (dram/journal.py). The lock file (held by this process only, never passed to clients, whose
    copies of the pool fd would keep a lock on it alive) keeps two servers off one pool."""
    lock_fd = os.open(os.path.join(pool_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(lock_fd)
        raise PoolCapacityError(f"--pool-dir {pool_dir}: another pegaflow-server uses this pool") from exc
    path = os.path.join(pool_dir, POOL_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    reused = os.fstat(fd).st_size == size_bytes
    return fd, lock_fd, reused


def _open_unlinked(pool_dir: str, name: str) -> int:
    """A fresh file in pool_dir, unlinked at once: like a memfd, it lives only as long as its fds and maps."""
    for _ in range(16):
        path = os.path.join(pool_dir, f".{name}-{os.getpid()}-{os.urandom(6).hex()}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        os.unlink(path)
        return fd
    raise PoolCapacityError(f"could not create a pool file in {pool_dir}")


@dataclasses.dataclass(frozen=True)
class RegionPart:
    """One memfd of the region: the shared pool (name "") or a tenant's memory of its own, at
    ``base`` in the server's one mapping of them all. A client is handed one part's fd and maps
    only it; the offsets it is told are then relative to ``base``."""

    name: str
    base: int
    size_bytes: int
    fd: int


# mmap(2) flags the mmap module does not name (Linux, the same on x86-64 and arm64).
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]


def _map_fixed(address: int, size: int, fd: int) -> None:
    """Maps ``fd`` shared (and pre-faulted) at exactly ``address``, over what the reservation put there."""
    got = _libc.mmap(
        address,
        size,
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_SHARED | _MAP_FIXED | mmap.MAP_POPULATE,
        fd,
        0,
    )
    if got != address:
        err = ctypes.get_errno()
        raise OSError(err, f"could not map a pool part at {address:#x}: {os.strerror(err)}")


def _memfd(name: str, use_hugepages: bool) -> int:
    """An empty memfd that can be sealed (hugetlb-backed with ``use_hugepages``)."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    if use_hugepages:
        flags |= os.MFD_HUGETLB | os.MFD_HUGE_2MB
    return os.memfd_create(name, flags)


def _new_memfd(name: str, size_bytes: int, use_hugepages: bool) -> int:
    """A tenant region's part: a memfd of ``size_bytes``, allocated (PoolCapacityError if it cannot be)."""
    fd = _memfd(name, use_hugepages)
    try:
        os.ftruncate(fd, size_bytes)
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as exc:
        os.close(fd)
        raise PoolCapacityError(
            f"could not allocate {format_size(size_bytes)} for {name} "
            f"({'huge pages' if use_hugepages else 'shared memory'}): {exc.strerror}. "
            "Lower --pool-size or the tenants' region= sizes, or free memory."
        ) from exc
    return fd


class PoolRegion:
    """A memfd of ``size_bytes`` mapped into this process, with a numpy-friendly buffer; with tenant
    regions, several memfds (``parts``) mapped back to back as one buffer."""

    def __init__(
        self,
        fd: int,
        size_bytes: int,
        mapping: mmap.mmap,
        hugepages: bool,
        prefault_s: float,
        sealed: bool = False,
        persistent_dir: str | None = None,
        reused: bool = False,
        lock_fd: int = -1,
        parts: Sequence[RegionPart] = (),
        view_offset: int = 0,
    ):
        self.fd = fd  # the shared pool's memfd (parts[0])
        self.size_bytes = size_bytes
        self.hugepages = hugepages
        self.prefault_s = prefault_s
        self.sealed = sealed  # the fd's size cannot be changed by anyone holding it
        self.persistent_dir = persistent_dir  # a named pool file here outlives the process
        self.reused = reused  # it already held a pool of this size: its journal may name blocks
        self._lock_fd = lock_fd
        self._mapping: mmap.mmap | None = mapping
        self.parts: tuple[RegionPart, ...] = tuple(parts) or (RegionPart("", 0, size_bytes, fd),)
        self._view_offset = view_offset  # where the parts start in ``mapping`` (huge-page aligned)
        self._view: memoryview | None = None

    def part(self, name: str) -> RegionPart:
        """The part named ``name`` ("" is the shared pool); KeyError if there is none."""
        for part in self.parts:
            if part.name == name:
                return part
        raise KeyError(name)

    def file_at(self, offset: int) -> tuple[int, int]:
        """(fd, offset in that fd) of a byte of the region: what sendfile(2) needs."""
        for part in reversed(self.parts):
            if offset >= part.base:
                return part.fd, offset - part.base
        raise ValueError(f"offset {offset} is outside the pool")

    @classmethod
    def create_with_parts(
        cls,
        size_bytes: int,
        regions: Sequence[tuple[str, int]],
        align: int,
        use_hugepages: bool = False,
    ) -> PoolRegion:
        """The shared pool and one memfd per tenant region (``(name, bytes)``), each sealed like the pool,
        mapped back to back in this process so that the server (the block store, the SSD tier, peers,
        the GPU path) sees one buffer and one offset space. Every part starts on ``align`` (a slab: no
        slab straddles two memfds): the pool is rounded down to it, each region up."""
        if align % HUGEPAGE_BYTES:
            raise ValueError(f"parts must align to a multiple of 2 MiB, not {align}")
        pool_bytes = size_bytes // align * align
        if pool_bytes == 0:
            raise PoolCapacityError(
                f"--pool-size {format_size(size_bytes)} is smaller than one slab ({format_size(align)}) "
                "besides tenant regions"
            )
        sizes = [("", pool_bytes)] + [(name, -(-n // align) * align) for name, n in regions]
        total = sum(n for _, n in sizes)
        check_capacity(total, use_hugepages)
        # An address range for all parts at once, then each memfd mapped over its share of it. The
        # reservation is a mmap object, so closing it (munmap of the whole range) and the buffer
        # export checks stay the mmap module's; NORESERVE: it is never backed itself.
        reservation = mmap.mmap(
            -1, total + HUGEPAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        )
        start_addr = ctypes.addressof(ctypes.c_char.from_buffer(reservation))
        view_offset = -start_addr % HUGEPAGE_BYTES  # hugetlb mappings must start on a huge page
        parts: list[RegionPart] = []
        start = time.perf_counter()
        try:
            base = 0
            for name, nbytes in sizes:
                fd = _new_memfd(f"pegaflow-pool-{name}" if name else "pegaflow-pool", nbytes, use_hugepages)
                parts.append(RegionPart(name, base, nbytes, fd))
                if not seal_size(fd):
                    raise RuntimeError("this kernel could not seal the pool memfd against resizing")
                _map_fixed(start_addr + view_offset + base, nbytes, fd)
                base += nbytes
        except BaseException:
            for part in parts:
                os.close(part.fd)
            reservation.close()
            raise
        prefault_s = time.perf_counter() - start
        log.info(
            "pool: %s of %s and %d tenant region(s) (%s) allocated and pre-faulted in %.2f s",
            format_size(pool_bytes),
            "2 MiB huge pages" if use_hugepages else "shared memory",
            len(regions),
            ", ".join(f"{p.name} {format_size(p.size_bytes)}" for p in parts[1:]),
            prefault_s,
        )
        return cls(
            parts[0].fd,
            total,
            reservation,
            use_hugepages,
            prefault_s,
            sealed=True,
            parts=parts,
            view_offset=view_offset,
        )

    @classmethod
    def create(
        cls,
        size_bytes: int,
        use_hugepages: bool = False,
        pool_dir: str | None = None,
        name: str = "pegaflow-pool",
        persistent: bool = False,
    ) -> PoolRegion:
        """Checks capacity, then allocates and pre-faults the whole region (logged with its duration).

        Backing: an anonymous memfd (4 KiB pages), a hugetlb memfd with ``use_hugepages``, or
        with ``pool_dir`` an unlinked file in a tmpfs / hugetlbfs mount (a tmpfs mounted with
        ``huge=always`` gives transparent 2 MiB pages without reserving hugetlb pages).
        """
        if use_hugepages and pool_dir:
            raise ValueError("use either hugetlb pages or a pool directory, not both")
        if persistent and not pool_dir:
            raise ValueError("a persistent pool needs a pool directory (a tmpfs or hugetlbfs mount)")
        fstype = _check_pool_dir(pool_dir) if pool_dir else None
        huge_backing = use_hugepages or fstype == "hugetlbfs"
        if huge_backing and size_bytes % HUGEPAGE_BYTES:
            rounded = -(-size_bytes // HUGEPAGE_BYTES) * HUGEPAGE_BYTES
            log.info("pool size %d rounded up to %d (a multiple of 2 MiB huge pages)", size_bytes, rounded)
            size_bytes = rounded
        lock_fd, reused = -1, False
        if persistent:
            fd, lock_fd, reused = _open_persistent(pool_dir, size_bytes)
            if not reused:
                check_capacity(size_bytes, huge_backing)
                _check_dir_room(pool_dir, size_bytes)
        elif pool_dir:
            check_capacity(size_bytes, huge_backing)
            _check_dir_room(pool_dir, size_bytes)
            fd = _open_unlinked(pool_dir, name)
        else:
            check_capacity(size_bytes, huge_backing)
            fd = _memfd(name, use_hugepages)
        try:
            if not reused:
                os.ftruncate(fd, size_bytes)
            start = time.perf_counter()
            try:
                os.posix_fallocate(fd, 0, size_bytes)
            except OSError as exc:
                raise PoolCapacityError(
                    f"could not allocate a {format_size(size_bytes)} pool "
                    f"({'huge pages' if huge_backing else 'shared memory'}): {exc.strerror}. "
                    "Lower --pool-size or free memory."
                ) from exc
            mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            prefault_s = time.perf_counter() - start
            # After sizing and allocating, before the fd is passed to anyone.
            sealed = seal_size(fd)
            if not sealed and not pool_dir:
                raise RuntimeError("this kernel could not seal the pool memfd against resizing")
        except BaseException:
            os.close(fd)
            if lock_fd >= 0:
                os.close(lock_fd)
            raise
        if not sealed:
            log.warning(
                "pool: the file in --pool-dir %s cannot be sealed against resizing (Linux seals memfds "
                "only): a local user who can reach the fd socket could truncate it under other clients. "
                "Use the default memfd backing unless every such user is trusted.",
                pool_dir,
            )
        backing = (
            "2 MiB huge pages"
            if use_hugepages
            else f"a file in {pool_dir} ({fstype})"
            if pool_dir
            else "shared memory (4 KiB pages)"
        )
        log.info(
            "pool: %s of %s allocated and pre-faulted in %.2f s", format_size(size_bytes), backing, prefault_s
        )
        if persistent:
            log.info("pool: persistent in %s (%s)", pool_dir, "re-adopted" if reused else "new")
        return cls(
            fd,
            size_bytes,
            mapping,
            huge_backing,
            prefault_s,
            sealed,
            persistent_dir=pool_dir if persistent else None,
            reused=reused,
            lock_fd=lock_fd,
        )

    @property
    def buffer(self) -> mmap.mmap | memoryview:
        """Every part, back to back: offsets into it are the server's block offsets."""
        if self._mapping is None:
            raise ValueError("pool region is closed")
        if len(self.parts) == 1:
            return self._mapping
        if self._view is None:
            self._view = memoryview(self._mapping)[self._view_offset : self._view_offset + self.size_bytes]
        return self._view

    def close(self) -> None:
        """Unmaps and closes the memfd. Pages are freed once every client has unmapped too."""
        if self._view is not None:
            try:
                self._view.release()
            except BufferError:
                pass  # a view of it is still alive: the mapping is left to the GC, as below
            self._view = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                # A view (e.g. a test's numpy array) still exports the buffer: leave the mapping to the GC.
                pass
            self._mapping = None
        if self.fd >= 0:
            for part in self.parts:
                os.close(part.fd)
            self.fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
