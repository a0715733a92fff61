"""Host byte copies with streaming stores, outside the interpreter lock (page_copy.c says why).

``copy(dst, src)`` is ``np.copyto(dst, src)`` for two ``[pages, page_bytes]`` byte views whose
pages are contiguous: the connector's views of vLLM's pages and of the pool (connector/kv_pages.py),
the client's runs of blocks into and out of the pool (client/block_copy.py). It is native once
``start()`` has built the module and proven it in a child process (extension.py), which happens on
a thread of its own, so no caller waits for a compiler; until then, where it cannot be built or
proven, or with ``PEGAFLOW_NATIVE_COPY=0``, it is numpy's.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from pegaflow.common.native.extension import NativeExtension
from pegaflow.common.native.optional import OptionalNative

log = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page_copy.c")
ENV_SWITCH = "PEGAFLOW_NATIVE_COPY"

# The child's self-test (no numpy there: ``python -S``): 2-D byte views of bytearrays, pages below
# and above the streaming threshold, a misaligned destination, and each refusal.
_CHILD = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
for rows, row, skew in ((3, 1000, 0), (2, 200003, 0), (4, 65536, 7)):
    src = bytearray((i * 7 + 3) % 251 for i in range(rows * row))
    raw = bytearray(rows * row + skew)
    dst = memoryview(raw)[skew:].cast("B", (rows, row))
    assert mod.copy_pages(dst, memoryview(src).cast("B", (rows, row))) == rows * row
    assert bytes(raw[skew:]) == bytes(src)
a = memoryview(bytearray(64)).cast("B", (4, 16))
narrow = memoryview(bytearray(60)).cast("B", (4, 15))
read_only = memoryview(bytes(64)).cast("B", (4, 16))
for bad in ((a, narrow), (a, a), (read_only, a)):
    try:
        mod.copy_pages(*bad)
    except (ValueError, TypeError, BufferError):
        pass
    else:
        raise AssertionError("copy_pages accepted %r" % (bad,))
"""

EXTENSION = NativeExtension(SOURCE, "_pegaflow_page_copy", _CHILD, "the native page copy")
NATIVE = OptionalNative(EXTENSION, "copy_pages", ENV_SWITCH, "host page copies use numpy", log)
start = NATIVE.start
use = NATIVE.use
is_native = NATIVE.is_native


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """Copies ``src`` into ``dst``: two byte arrays of one shape ``[pages, page_bytes]``, each page
    contiguous. Views that may overlap (e.g. two runs of one pool) go to numpy, which copies them as
    if through a temporary; the native copy refuses them."""
    native = NATIVE.get()
    if native is None or np.may_share_memory(dst, src):
        np.copyto(dst, src)
    else:
        native(dst, src)
