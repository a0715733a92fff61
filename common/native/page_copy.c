/* Host KV page copies outside the interpreter lock, with non-temporal stores.
 *
 * A warm request's load copies every layer's pages of its blocks from the pool into vLLM's KV cache
 * (78 MiB for the 10K-token prompt of bench/ttft.py) on the core vLLM reserves for transfers, while
 * the forward computes on the other one. numpy's copyto is glibc's memcpy per page: for pages below
 * glibc's non-temporal threshold (3/4 of the last-level cache) it stores through the cache, which
 * first reads each destination line (a third memory transfer per byte) and evicts what the forward
 * had in the cache. Streaming stores write the lines without reading them: on the 2-vCPU AMD EPYC VM,
 * a cache-cold 78 MiB request's pages moved at 16.4 GB/s against numpy's 13.9 for loads and 16.9
 * against 13.6 for saves, single thread (bench/page_copy_bench.py, medians of 40 rounds,
 * bench/results/page_copy_2026-12-06_native.json). The bytes are read next by
 * the forward, layer by layer, long after this copy evicted them from the cache either way.
 * The client's block copies into and out of the pool (client/block_copy.py) use it too: a save's
 * pool slots are read by nobody soon, so the same reasoning holds (bench/server_bench.py).
 *
 *   copy_pages(dst, src) -> int
 *
 * ``dst`` (writable) and ``src``: buffers of the same 2-D shape [pages, page_bytes] of 1-byte items,
 * each row contiguous, rows at any stride (numpy views of vLLM's pages and of the pool's strided
 * layer pages). Returns the bytes copied. Rows of at least NT_MIN_BYTES use streaming stores (SSE2,
 * part of every x86-64 CPU, so no CPU of the kind lacks them); shorter rows, and other architectures,
 * use memcpy. Raises ValueError for shapes that differ, rows that are not contiguous, or buffers that
 * overlap. The copy runs with the interpreter lock released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define NT_MIN_BYTES (64 * 1024)

#if defined(__SSE2__)
static void stream_row(char *d, const char *s, size_t n) {
    /* head up to 16-byte alignment of the destination, then 64 bytes per round, then the tail */
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
}
#endif

/* [lo, hi) of the bytes a 2-D view touches */
static void extent(const Py_buffer *v, uintptr_t *lo, uintptr_t *hi) {
    uintptr_t base = (uintptr_t)v->buf;
    Py_ssize_t rows = v->shape[0], stride = v->strides[0], row = v->shape[1];
    if (rows == 0 || row == 0) {
        *lo = *hi = base;
        return;
    }
    uintptr_t last = base + (uintptr_t)((rows - 1) * stride);
    *lo = stride < 0 ? last : base;
    *hi = (stride < 0 ? base : last) + (uintptr_t)row;
}

static PyObject *copy_pages(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OO", &dst_obj, &src_obj)) return NULL;
    Py_buffer dst, src;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_STRIDES | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_STRIDES) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    const char *why = NULL;
    if (dst.ndim != 2 || src.ndim != 2)
        why = "copy_pages: dst and src must be 2-D [pages, page_bytes]";
    else if (dst.itemsize != 1 || src.itemsize != 1)
        why = "copy_pages: dst and src must be byte buffers";
    else if (dst.shape[0] != src.shape[0] || dst.shape[1] != src.shape[1])
        why = "copy_pages: dst and src differ in shape";
    else if ((dst.shape[1] > 1 && dst.strides[1] != 1) || (src.shape[1] > 1 && src.strides[1] != 1))
        why = "copy_pages: each page must be contiguous";
    if (why == NULL) {
        uintptr_t dlo, dhi, slo, shi;
        extent(&dst, &dlo, &dhi);
        extent(&src, &slo, &shi);
        if (dlo < shi && slo < dhi) why = "copy_pages: dst and src overlap";
    }
    if (why != NULL) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, why);
        return NULL;
    }
    Py_ssize_t rows = dst.shape[0], row = dst.shape[1];
    Py_BEGIN_ALLOW_THREADS
    int streamed = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        char *d = (char *)dst.buf + r * dst.strides[0];
        const char *s = (const char *)src.buf + r * src.strides[0];
#if defined(__SSE2__)
        if (row >= NT_MIN_BYTES) {
            stream_row(d, s, (size_t)row);
            streamed = 1;
            continue;
        }
#endif
        memcpy(d, s, (size_t)row);
    }
#if defined(__SSE2__)
    if (streamed) _mm_sfence(); /* the streamed lines are visible to every core before we return */
#endif
    (void)streamed;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromSsize_t(rows * row);
}

static PyMethodDef methods[] = {
    {"copy_pages", copy_pages, METH_VARARGS,
     "copy_pages(dst, src) -> int: rows of two 2-D byte buffers of one shape, copied without the "
     "interpreter lock (streaming stores for rows of 64 KiB and more)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, MODULE_NAME, NULL, -1, methods};

#define INIT_NAME2(sym) PyInit_##sym
#define INIT_NAME(sym) INIT_NAME2(sym)
PyMODINIT_FUNC INIT_NAME(MODULE_SYMBOL)(void) { return PyModule_Create(&module); }
