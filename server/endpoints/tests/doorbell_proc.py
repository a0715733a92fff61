"""A doorbell in a process of its own, over a StandInGpu, for tests that stop or kill its server.

    python -m pegaflow.server.endpoints.tests.doorbell_proc PATH EPOCH

Prints "ready" once it listens; serves until SIGTERM.
"""

from __future__ import annotations

import signal
import sys

from pegaflow.server.config import ServerConfig
from pegaflow.server.endpoints.doorbell import DoorbellServer
from pegaflow.server.endpoints.tests.support import StandInGpu


def main() -> None:
    path, epoch = sys.argv[1], sys.argv[2]
    server = DoorbellServer(path, StandInGpu(), epoch, ServerConfig(pool_size_bytes=64 << 20))
    server.start()
    print("ready", flush=True)
    signal.sigwait([signal.SIGTERM])
    server.stop(grace_s=0)


if __name__ == "__main__":
    main()
