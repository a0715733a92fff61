# Sourced at the start of a benchmark command on a lent GPU machine (no package index there).
#
# Here, once: the wheels it lacks, for its Python 3.12, into .whl/ (gitignored; carried by the call):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2 prometheus_client==0.26.0 \
#     xxhash==4.1.0 psutil uvloop pyzmq pegaflow-llm-cu13==0.25.1
# and the gRPC stubs (`make proto`; carried as proto/). Then, as the device call's command:
#   . bench/device_env.sh && python3 bench/tail_latency.py --anchor-site /tmp/anchor --out /tmp/tl ...
#
# It installs the wheels into /tmp/site and PegaFlow (the anchor, also a package named pegaflow) into
# /tmp/anchor, makes this checkout importable as `pegaflow` (/tmp/pp/pegaflow -> here), and says
# whether the native parts can be built there (C compiler, Python headers) and prove themselves:
# without them the server runs, but every query goes to the engine (the read lane), and the client
# waits for answers in Python (client/native/frame_wait.py).
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    $(ls .whl/*.whl | grep -v pegaflow_llm)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/anchor .whl/pegaflow_llm*.whl
mkdir -p /tmp/pp
ln -sfn "$PWD" /tmp/pp/pegaflow
export PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1
python3 - <<'EOF'
import os, shutil, sysconfig
inc = sysconfig.get_paths()["include"]
print(f"device: python headers {inc}: {os.path.exists(os.path.join(inc, 'Python.h'))}; gcc {shutil.which('gcc')}")
from pegaflow.server.read_lane import native
print("device: read lane:", native.probe() or "ok")
from pegaflow.client.native import frame_wait
print("device: client native frame wait:", frame_wait.EXTENSION.probe() or "ok")
EOF
set +e
