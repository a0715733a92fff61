"""Real file systems for the SSD tier's fault tests (tier level and through the server): a fresh
ext4 on a loop device, filled or shrunk under a running tier. Root and losetup are needed; without
them the calling test is skipped with the reason (pytest is imported only then: the server's
slim install has none)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

MIB = 1 << 20


def need_root_and(tool: str) -> None:
    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root (mount / losetup)")
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")


@contextlib.contextmanager
def loop_fs(tmp_path, size_mib: int):
    """A fresh ext4 (no reserved blocks) on a loop device over a sparse image, mounted in
    tmp_path/mnt; yields (mount point, device, image)."""
    import pytest

    need_root_and("losetup")
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mib * MIB)
    try:
        dev = subprocess.run(
            ["losetup", "-f", "--show", str(image)], capture_output=True, text=True, check=True
        )
    except subprocess.CalledProcessError as e:
        pytest.skip(f"losetup is unavailable here: {e.stderr.strip()}")
    dev = dev.stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", "-m", "0", dev], check=True, capture_output=True)
        mounted = subprocess.run(["mount", dev, str(mnt)], capture_output=True, text=True)
        if mounted.returncode:
            pytest.skip(f"cannot mount a loop device here: {mounted.stderr.strip()}")
        try:
            yield mnt, dev, image
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", dev], check=False, capture_output=True)


def fill_fs(folder) -> None:
    """Takes every free block of the file system under ``folder``."""
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        vfs = os.statvfs(folder)
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, vfs.f_bavail * vfs.f_frsize)
        chunk = b"\xff" * 4096
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, chunk)
    finally:
        os.close(fd)


def shrink_device(dev: str, image, keep_bytes: int) -> None:
    """A real EIO: the loop device's image is cut to ``keep_bytes`` and the device told, so every
    block past it fails in the block layer (this kernel has no device-mapper to inject errors)."""
    os.truncate(image, keep_bytes)
    subprocess.run(["losetup", "-c", dev], check=True)
