"""``python -m pegaflow.server``: the pegaflow-server command line (same as ``pegaflow-server``)."""

import sys

from pegaflow.server.main import main

if __name__ == "__main__":
    sys.exit(main())
