"""The daemons' logging (common/log_queue.py through cli.configure_logging): a stderr nobody reads
never blocks the thread that logs; lines are dropped and counted instead, and said when it drains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# A child process whose stderr is a pipe this test does not read until the child has logged far more
# than the pipe holds (64 KiB), then says on stdout how long its slowest logging call took.
_CHILD = textwrap.dedent(
    """
    import json, logging, sys, time
    from pegaflow.common.cli import configure_logging
    configure_logging("info")
    log = logging.getLogger("child")
    slowest = 0.0
    for i in range(20_000):  # ~2 MB of lines
        t0 = time.monotonic()
        log.info("line %d %s", i, "x" * 80)
        slowest = max(slowest, time.monotonic() - t0)
    print(json.dumps({"slowest_s": slowest}), flush=True)
    """
)


@pytest.mark.timeout(60)
def test_logging_never_waits_for_a_stderr_nobody_reads():
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    try:
        line = proc.stdout.readline()  # while its stderr is full and unread
        assert line, "the child blocked in a logging call (or died)"
        assert json.loads(line)["slowest_s"] < 1.0
        err = proc.stderr.read().decode()  # now read: the writer drains, and says what it dropped
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert "line 0 " in err
    assert "log lines dropped: stderr was not read" in err
