"""Native code pegaflow builds on first use with the system's C compiler (the server's read lane and
io_uring binding, the client's frame wait): where a build is cached (cache.py) and how a CPython
extension is built, proven in a child process and loaded (extension.py)."""
