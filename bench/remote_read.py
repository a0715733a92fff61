"""The reduced remote-read regression: `python -m pegaflow.bench.remote_read` (what
`bazel test //bench:remote_read` runs, through bench/tests/test_e2e_remote_read.py).

Two pegaflow-server nodes and a metaserver in network namespaces: node B pulls 64 MiB prefixes node
A holds, which must arrive whole and byte-identical; then, when PegaKVConnector waits for remote
blocks, vLLM on B serves prompts vLLM on A computed, which must load from A's blocks and generate
A's tokens (skipped with the reason otherwise). Exit 1 on a failure, 2 when namespaces cannot be
made here. What it checks and why: bench/experiments/remote_read.py. ~15 s without the vLLM part,
~3 min with it, on 2 cores.

    python -m pegaflow.bench.remote_read [--workdir DIR] [--out DIR]
"""

import sys

from pegaflow.bench.experiments import remote_read

if __name__ == "__main__":
    sys.exit(remote_read.main(["--regression", *sys.argv[1:]]))
