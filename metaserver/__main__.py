"""``python -m pegaflow.metaserver``: the same as the ``pegaflow-metaserver`` script."""

import sys

from pegaflow.metaserver.main import main

sys.exit(main())
