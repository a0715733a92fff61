"""Helpers that tests and benchmarks of every part share (no part imports them at run time).

`netns.py` builds "other hosts" out of Linux network namespaces joined by veth pairs or a bridge;
`tls.py` is a throw-away certificate authority (and token files) for the TLS / auth tests.
"""
