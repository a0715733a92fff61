"""A small cffi (API mode) binding over the system's liburing, compiled on first use, and the
child-process probe that must pass before the tier trusts it.

Why our own binding (measured on this machine kind, see /work/shared/recipes/toolchain.md):
PyPI ``liburing`` 2026.3.30 dies with SIGILL on AMD EPYC machines when a ring is created (a kill
no ``except`` catches); ``pyuring`` 0.3.3 is source-only and needs newer liburing headers than
Debian 12's 2.3. Most of liburing's API is ``static inline`` in its header, so ctypes alone
cannot call it: cffi's API mode compiles a tiny extension that includes the header. The C code
here does the whole per-call loop (queue SQEs; submit + wait + reap a batch of CQEs), so Python
makes one call per batch and the wait runs with the GIL released (cffi releases it around every
call). It is built with the system gcc and generic flags against Debian's liburing 2.3
(``liburing-dev``, installed by ci/apt.sh), so it runs on any x86-64 CPU.

The build goes into a cache folder keyed by a hash of everything that shapes the binary (this
source, cffi and Python versions, the liburing header), so pytest from the tree, ``pip install
-e .`` and Bazel's sandboxed tests (no network; HOME private) each build once and reuse it.
Concurrent builders (two test processes) each build in a private temporary folder and
``rename`` the result into place: the last rename wins and both are identical.

``probe(directory)`` loads the built module in a *child* process, creates a ring and does one
real O_DIRECT write and read back of a file in ``directory``; a crash (SIGILL), an error or a
timeout there costs only the child, and the tier falls back to threads with one log line.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
from functools import partial

from pegaflow.common.native.cache import cached_build, load_built

log = logging.getLogger(__name__)

CDEF = r"""
struct iovec { void *iov_base; size_t iov_len; };
struct pf_ring;
int pf_ring_open(struct pf_ring **out, unsigned entries);
void pf_ring_close(struct pf_ring *r);
int pf_queue_rw(struct pf_ring *r, int write, int fd, const struct iovec *iov, unsigned nr,
                unsigned long long offset, unsigned long long user_data);
int pf_queue_read(struct pf_ring *r, int fd, void *buf, unsigned len, unsigned long long offset,
                  unsigned long long user_data);
int pf_submit_reap(struct pf_ring *r, unsigned wait_nr, unsigned long long *user_data, int *res,
                   unsigned max);
int pf_probe(const char *path);
"""

SOURCE = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/uio.h>
#include <liburing.h>

struct pf_ring { struct io_uring ring; };

int pf_ring_open(struct pf_ring **out, unsigned entries) {
    struct pf_ring *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    int rc = io_uring_queue_init(entries, &r->ring, 0);
    if (rc < 0) { free(r); return rc; }
    *out = r;
    return 0;
}

void pf_ring_close(struct pf_ring *r) {
    io_uring_queue_exit(&r->ring);
    free(r);
}

/* Queues one vectored read or write (not submitted yet). -EBUSY: the submission queue is full. */
int pf_queue_rw(struct pf_ring *r, int write, int fd, const struct iovec *iov, unsigned nr,
                unsigned long long offset, unsigned long long user_data) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (!sqe) return -EBUSY;
    if (write) io_uring_prep_writev(sqe, fd, iov, nr, offset);
    else io_uring_prep_readv(sqe, fd, iov, nr, offset);
    io_uring_sqe_set_data64(sqe, user_data);
    return 0;
}

int pf_queue_read(struct pf_ring *r, int fd, void *buf, unsigned len, unsigned long long offset,
                  unsigned long long user_data) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (!sqe) return -EBUSY;
    io_uring_prep_read(sqe, fd, buf, len, offset);
    io_uring_sqe_set_data64(sqe, user_data);
    return 0;
}

/* Submits what is queued, waits until wait_nr completions are ready (0: do not wait), and reaps
   up to max of them. Returns how many were reaped, or -errno. An interrupted wait (EINTR) reaps
   what is there: the caller loops. */
int pf_submit_reap(struct pf_ring *r, unsigned wait_nr, unsigned long long *user_data, int *res,
                   unsigned max) {
    int rc = io_uring_submit_and_wait(&r->ring, wait_nr);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && rc != -ETIME) return rc;
    unsigned head, n = 0;
    struct io_uring_cqe *cqe;
    io_uring_for_each_cqe(&r->ring, head, cqe) {
        if (n == max) break;
        user_data[n] = cqe->user_data;
        res[n] = cqe->res;
        n++;
    }
    io_uring_cq_advance(&r->ring, n);
    return (int)n;
}

/* One real O_DIRECT write and read back through a ring. 0 = works; <0 = -errno; 200 + n: step n failed. */
int pf_probe(const char *path) {
    struct pf_ring *r = NULL;
    int rc = pf_ring_open(&r, 4);
    if (rc < 0) return rc;
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0) { rc = -errno; pf_ring_close(r); return rc; }
    void *a = NULL, *b = NULL;
    if (posix_memalign(&a, 4096, 8192) || posix_memalign(&b, 4096, 8192)) { rc = 201; goto out; }
    for (int i = 0; i < 8192; i++) ((unsigned char *)a)[i] = (unsigned char)(i * 7 + 3);
    memset(b, 0, 8192);
    struct iovec wv[2] = {{a, 4096}, {(char *)a + 4096, 4096}};
    struct iovec rv[2] = {{b, 4096}, {(char *)b + 4096, 4096}};
    unsigned long long ud[2];
    int res[2];
    if (pf_queue_rw(r, 1, fd, wv, 2, 0, 11) < 0) { rc = 202; goto out; }
    if ((rc = pf_submit_reap(r, 1, ud, res, 2)) != 1) { rc = rc < 0 ? rc : 203; goto out; }
    if (ud[0] != 11 || res[0] != 8192) { rc = res[0] < 0 ? res[0] : 204; goto out; }
    if (pf_queue_rw(r, 0, fd, rv, 2, 0, 12) < 0) { rc = 205; goto out; }
    if ((rc = pf_submit_reap(r, 1, ud, res, 2)) != 1) { rc = rc < 0 ? rc : 206; goto out; }
    if (ud[0] != 12 || res[0] != 8192) { rc = res[0] < 0 ? res[0] : 207; goto out; }
    rc = memcmp(a, b, 8192) ? 208 : 0;
out:
    free(a);
    free(b);
    close(fd);
    unlink(path);
    pf_ring_close(r);
    return rc;
}
"""

_LIBURING_HEADER = "/usr/include/liburing.h"
_build_lock = threading.Lock()
_built: dict[str, str] = {}


class UringUnavailable(RuntimeError):
    """The binding could not be built or loaded (no compiler, no liburing headers, ...)."""


def _build_key() -> str:
    import cffi

    h = hashlib.sha256()
    for part in (CDEF, SOURCE, cffi.__version__, sys.version, sysconfig.get_platform(), sys.abiflags):
        h.update(part.encode())
    try:
        with open(_LIBURING_HEADER, "rb") as f:
            h.update(f.read())
    except OSError as e:
        raise UringUnavailable(
            f"liburing headers missing ({_LIBURING_HEADER}: {e.strerror}); install liburing-dev"
        ) from e
    return h.hexdigest()[:16]


def module_path() -> str:
    """Path of the compiled extension, building it on first use. Raises UringUnavailable."""
    key = _build_key()
    with _build_lock:
        if key in _built:
            return _built[key]
        name = f"_pegaflow_uring_{key}"
        try:
            target = cached_build(name + importlib.machinery.EXTENSION_SUFFIXES[0], partial(_compile, name))
        except RuntimeError as e:
            raise UringUnavailable(f"could not build the io_uring binding: {e}") from e
        _built[key] = target
        return target


def _compile(name: str, work: str, target: str) -> None:
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(name, SOURCE, libraries=["uring"], extra_compile_args=["-O2"])
    # distutils/setuptools print the compiler lines on stdout: keep them out of the server's log.
    os.replace(ffi.compile(tmpdir=work, verbose=False), target)


def load():
    """(ffi, lib) of the compiled binding in this process. Raises UringUnavailable."""
    path = module_path()
    try:
        mod = load_built(path)
    except ImportError as e:
        raise UringUnavailable(f"cannot load {path}: {e}") from e
    return mod.ffi, mod.lib


_CHILD = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
rc = mod.lib.pf_probe(sys.argv[3].encode())
sys.exit(min(-rc, 199) if rc < 0 else rc)
"""

PROBE_TIMEOUT_S = 20.0
_probe_cache: dict[tuple[str, int], str | None] = {}


def probe(directory: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when io_uring works for O_DIRECT files in ``directory`` (checked in a child process),
    else why not. Cached per (binding, file system) for the life of this process."""
    try:
        path = module_path()
    except UringUnavailable as e:
        return str(e)
    key = (path, os.stat(directory).st_dev)
    if key in _probe_cache:
        return _probe_cache[key]
    name = os.path.basename(path).split(".")[0]
    fd, scratch = tempfile.mkstemp(prefix=".pegaflow-uring-probe-", dir=directory)
    os.close(fd)
    import _cffi_backend  # the only module the child needs besides the standard library

    # -S: no site processing (.pth files, site-packages scan): 0.03 s to start instead of 0.25 s here.
    env = {**os.environ, "PYTHONPATH": os.path.dirname(_cffi_backend.__file__)}
    try:
        child = subprocess.run(
            [sys.executable, "-S", "-c", _CHILD, name, path, scratch],
            capture_output=True,
            timeout=timeout_s,
            env=env,
        )
        code = child.returncode
        if code == 0:
            why = None
        elif code < 0:
            why = f"the io_uring probe process died with signal {-code}"
        else:
            detail = (child.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
            step = f"step {code - 200} failed" if code >= 200 else os.strerror(code)
            why = f"the io_uring probe failed ({step}) {detail}".rstrip()
    except subprocess.TimeoutExpired:
        why = f"the io_uring probe did not finish within {timeout_s:.0f} s"
    finally:
        try:
            os.unlink(scratch)
        except FileNotFoundError:
            pass
    _probe_cache[key] = why
    return why
