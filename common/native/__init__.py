"""Native code pegaflow builds on first use with the system's C compiler (the server's read lane and
io_uring binding, the client's frame wait, the host page copies of page_copy.c): where a build is
cached (cache.py), how a CPython extension is built, proven in a child process and loaded
(extension.py), and how an optional native function replaces its Python fallback once it is
(optional.py)."""
