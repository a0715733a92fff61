"""Helpers that tests and benchmarks of every part share (no part imports them at run time).

`netns.py` builds "other hosts" out of Linux network namespaces joined by veth pairs or a bridge.
"""
