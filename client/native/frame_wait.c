/* The client's wait for a local socket's answer, outside the interpreter lock.
 *
 * A local call's answer comes within tens of microseconds (the read lane) to milliseconds (a GPU
 * copy behind the doorbell). Waiting for it in Python (client/frame_link.py) polls the socket in a
 * loop, and every poll releases and re-takes the interpreter lock: in a process where other Python
 * threads run (vLLM's, a benchmark's load), each re-take may wait for another thread's turn, and a
 * thread spinning hot hands the lock back and forth thousands of times a second. Here the whole wait
 * (the spin, the sleep in the kernel, the frame's length and body) runs with the lock released once,
 * and taken once at the end.
 *
 *   recv_frame(fd, limit, spin_s, yield_cpu, deadline, held_s=0.0) -> (code, value)
 *
 * ``fd``: a connected, non-blocking stream socket. ``limit``: the longest body accepted.
 * ``spin_s``: how long to poll without sleeping (``yield_cpu``: sched_yield between polls, so the spin
 * only takes idle CPU). ``deadline``: time.monotonic() value (CLOCK_MONOTONIC) by which the whole
 * frame must be in. ``held_s``: first wait up to this long keeping the lock (a caller every other
 * thread waits for, such as vLLM's scheduler looking up a prompt: an answer that comes in time is
 * not held up by taking the lock back). The frame is common/wire/frames.py's: u32 little-endian
 * body length, body.
 * Codes (the Python side, client/native/frame_wait.py, turns them into frames.read_frame's results):
 *   0 value = the body (bytes; b"" is the server's GOODBYE)
 *   1 value = None: the peer closed the connection before a frame began
 *   2 the deadline passed
 *   3 value = errno of a failed recv or poll
 *   4 the peer closed the connection inside a frame
 *   5 value = the announced length, longer than ``limit`` (the body is left unread)
 * A signal that interrupts the wait runs its Python handler (the lock taken for it), then the wait and
 * the read go on where they were, as Python's own socket calls do; if the handler raises, so does this.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

enum { FW_OK = 0, FW_EOF = 1, FW_TIMEOUT = 2, FW_ERRNO = 3, FW_CUT = 4, FW_TOO_LARGE = 5, FW_SIGNAL = 6 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* 1 readable (or hung up), 0 deadline passed, -errno. EINTR is returned as FW_SIGNAL's cue. */
static int wait_readable(int fd, double spin_s, int yield_cpu, double deadline) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    double start = now_s();
    for (;;) { /* the spin: no sleep, the answer is expected soon */
        int r = poll(&p, 1, 0);
        if (r > 0) return 1;
        if (r < 0) return -errno;
        double t = now_s();
        if (t - start >= spin_s || t >= deadline) break;
        if (yield_cpu) sched_yield();
    }
    for (;;) {
        double left = deadline - now_s();
        if (left <= 0) return 0;
        int ms = (int)(left * 1000.0) + 1; /* never 0 while time is left: that would spin */
        int r = poll(&p, 1, ms);
        if (r > 0) return 1;
        if (r < 0) return -errno;
    }
}

/* Reads into buf until *got == n (resumable: *got counts what earlier calls read). FW_OK, FW_EOF
 * (nothing read and allow_eof), FW_CUT, FW_TIMEOUT, FW_ERRNO (*err set), FW_SIGNAL (call again). */
static int read_exact(int fd, char *buf, size_t n, size_t *got, double deadline, int allow_eof, int *err) {
    while (*got < n) {
        ssize_t r = recv(fd, buf + *got, n - *got, MSG_DONTWAIT);
        if (r > 0) {
            *got += (size_t)r;
            continue;
        }
        if (r == 0) return (allow_eof && *got == 0) ? FW_EOF : FW_CUT;
        if (errno == EINTR) return FW_SIGNAL;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            *err = errno;
            return FW_ERRNO;
        }
        int w = wait_readable(fd, 0.0, 0, deadline);
        if (w == 0) return FW_TIMEOUT;
        if (w == -EINTR) return FW_SIGNAL;
        if (w < 0) {
            *err = -w;
            return FW_ERRNO;
        }
    }
    return FW_OK;
}

/* One pass of the read's state machine (see recv_frame), with or without the interpreter lock. */
static int advance(int fd, Py_ssize_t limit, double spin_s, int yield_cpu, double deadline, int *stage,
                   unsigned char *head, size_t *head_got, char **body, size_t *body_got, uint32_t *size,
                   int *err) {
    int code = FW_OK;
    if (*stage == 0) {
        int w = wait_readable(fd, spin_s, yield_cpu, deadline);
        if (w == 0) code = FW_TIMEOUT;
        else if (w == -EINTR) code = FW_SIGNAL;
        else if (w < 0) code = FW_ERRNO, *err = -w;
        else *stage = 1;
    }
    if (code == FW_OK && *stage == 1) {
        code = read_exact(fd, (char *)head, 4, head_got, deadline, 1, err);
        if (code == FW_OK) {
            *size = (uint32_t)head[0] | (uint32_t)head[1] << 8 | (uint32_t)head[2] << 16 |
                    (uint32_t)head[3] << 24;
            if ((Py_ssize_t)*size > limit) {
                code = FW_TOO_LARGE;
            } else if (*size > 0) {
                *body = malloc(*size);
                if (*body == NULL) code = FW_ERRNO, *err = ENOMEM;
                else *stage = 2;
            }
        }
    }
    if (code == FW_OK && *stage == 2) code = read_exact(fd, *body, *size, body_got, deadline, 0, err);
    return code;
}

static PyObject *recv_frame(PyObject *self, PyObject *args) {
    int fd, yield_cpu;
    Py_ssize_t limit;
    double spin_s, deadline, held_s = 0.0;
    if (!PyArg_ParseTuple(args, "indpd|d", &fd, &limit, &spin_s, &yield_cpu, &deadline, &held_s)) return NULL;
    if (limit < 0) {
        PyErr_SetString(PyExc_ValueError, "limit must not be negative");
        return NULL;
    }
    /* A socket closed by another thread (its session ended) has fileno() -1, which poll() would skip
     * until the deadline: report it as Python's recv on a closed socket does, at once. */
    if (fd < 0) return Py_BuildValue("(ii)", FW_ERRNO, EBADF);
    /* Where the read stands, kept across a signal's handler: 0 waiting, 1 the length, 2 the body. */
    int stage = 0, code = FW_OK, err = 0;
    unsigned char head[4];
    size_t head_got = 0, body_got = 0;
    uint32_t size = 0;
    char *body = NULL;
    /* The held phase: up to held_s with the interpreter lock kept (no sleep; the CPU yielded between
     * polls as in the spin, so the server's thread gets a core on a small host), so that an
     * answer in that time is returned without winning the lock back from another thread (up to the
     * switch interval, 5 ms by default). Whatever is not in by then is waited for without it. */
    double held_until = held_s > 0 ? now_s() + held_s : 0.0;
    if (held_until > deadline) held_until = deadline;
    int held = held_s > 0;
    for (;;) {
        if (held) {
            code = advance(fd, limit, held_s, yield_cpu, held_until, &stage, head, &head_got, &body,
                           &body_got, &size, &err);
            held = 0;
            if (code == FW_TIMEOUT && now_s() < deadline) continue; /* not in yet: wait without it */
        } else {
            Py_BEGIN_ALLOW_THREADS
            code = advance(fd, limit, spin_s, yield_cpu, deadline, &stage, head, &head_got, &body,
                           &body_got, &size, &err);
            Py_END_ALLOW_THREADS
        }
        if (code != FW_SIGNAL) break;
        /* A signal broke the wait: its Python handler runs now, then the read goes on where it was. */
        if (PyErr_CheckSignals() < 0) {
            free(body);
            return NULL;
        }
    }
    PyObject *value;
    switch (code) {
    case FW_OK:
        value = PyBytes_FromStringAndSize(body, size);
        free(body);
        if (value == NULL) return NULL;
        return Py_BuildValue("(iN)", code, value);
    case FW_ERRNO:
        free(body);
        return Py_BuildValue("(ii)", code, err);
    case FW_TOO_LARGE:
        return Py_BuildValue("(iI)", code, size);
    default:
        free(body);
        return Py_BuildValue("(iO)", code, Py_None);
    }
}

/* send_now(fd, data) -> int: what one non-blocking send (MSG_DONTWAIT | MSG_NOSIGNAL) took of ``data``
 * at once, with the interpreter lock kept (Python's socket calls release it, and taking it back may
 * wait for another thread's switch interval), or -errno (-EAGAIN: nothing fitted). The caller sends
 * the rest, if any, the usual way. */
static PyObject *send_now(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "iy*", &fd, &data)) return NULL;
    ssize_t n = send(fd, data.buf, (size_t)data.len, MSG_DONTWAIT | MSG_NOSIGNAL);
    int err = errno;
    PyBuffer_Release(&data);
    return PyLong_FromSsize_t(n >= 0 ? n : -(Py_ssize_t)err);
}

static PyMethodDef methods[] = {
    {"send_now", send_now, METH_VARARGS,
     "send_now(fd, data) -> int: bytes sent at once without releasing the interpreter lock, or -errno."},
    {"recv_frame", recv_frame, METH_VARARGS,
     "recv_frame(fd, limit, spin_s, yield_cpu, deadline, held_s=0.0) -> (code, value): one frame, "
     "waited for without the interpreter lock after the first held_s."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, MODULE_NAME, NULL, -1, methods};

#define INIT_NAME2(sym) PyInit_##sym
#define INIT_NAME(sym) INIT_NAME2(sym)
PyMODINIT_FUNC INIT_NAME(MODULE_SYMBOL)(void) { return PyModule_Create(&module); }
