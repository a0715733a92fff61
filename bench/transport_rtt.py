"""Round trips of the local transports: the local RPC codec, the GPU doorbell codec, gRPC and a bare
Python Unix-socket ping-pong, each server in a process of its own, in one run.

    python -m pegaflow.bench.transport_rtt [--calls 3000] [--runs 3]

Writes bench/results/transport_rtt.json and .png. Scenarios (client: one thread, back to back):

* ``local_rpc_release_notfound``: ReleaseLease of an unknown session over the local RPC socket (the
  servicer's whole frame, an engine call, a NOT_FOUND answer with its metadata): the figure the
  local RPC socket was introduced with (51 us p50 on a quiet 2-vCPU VM, common/wire/local_rpc.py).
* ``grpc_release_notfound``: the same call over gRPC, the baseline in the same run.
* ``doorbell_save_1`` / ``doorbell_save_256``: a doorbell save of 1 / 256 hashes (the GPU bench's
  request size) answered by a data path that copies nothing: the codec and transport cost alone.
* ``*_linger0``: the same with the server's linger off, so every request goes through the loop
  thread's hand-off to a worker (what the first request after a quiet spell pays).
* ``raw_unix_pingpong``: 64 bytes there and back between two Python processes (sendall / recv, a
  blocked reader on each side): the floor for any Python Unix-socket round trip here.

Each scenario reports p50 / p99 / max per run, and the median and worst run of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------ the servers (child processes)


@dataclasses.dataclass
class _Saved:
    statuses: list
    written: int


@dataclasses.dataclass
class _Loaded:
    num_hits: int


class _NoCopyGpu:
    """A data path that answers at once: what is left of a doorbell call is its transport and codec."""

    doorbell_path = ""

    def save(self, session_id, reg_id, hashes, block_ids, deadline):
        return _Saved([1] * len(hashes), len(hashes))

    def load(self, session_id, reg_id, hashes, block_ids, deadline, purpose):
        return _Loaded(len(hashes))


def _serve(kind: str, path: str, linger_s: float) -> None:
    from pegaflow.server.config import ServerConfig

    config = ServerConfig(pool_size_bytes=32 << 20, addr="127.0.0.1:0", http_addr=None)
    stops = []
    if kind == "raw":
        if os.path.exists(path):
            os.unlink(path)  # the previous run's (this bench's own path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        print("ready", flush=True)
        conn, _ = listener.accept()
        while True:
            data = conn.recv(64)
            if not data:
                return
            conn.sendall(data)
    if kind == "doorbell":
        from pegaflow.server.endpoints.doorbell import DoorbellServer

        server = DoorbellServer(path, _NoCopyGpu(), "bench", config, linger_s=linger_s)
        server.start()
        stops.append(server.stop)
        print("ready", flush=True)
    elif kind == "local-rpc":
        from pegaflow.common.grpc_server import new_grpc_server
        from pegaflow.server.endpoints.grpc_servicer import EngineServicer, add_engine_servicer
        from pegaflow.server.endpoints.local_rpc import LocalRpcServer
        from pegaflow.server.engine import KVEngine

        engine = KVEngine(config)
        servicer = EngineServicer(engine, "", None)
        server = LocalRpcServer(path, servicer, engine.epoch, linger_s=linger_s)
        server.start()
        grpc_server = new_grpc_server(4, "bench-rpc", 8 << 20)
        add_engine_servicer(servicer, grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        grpc_server.start()
        stops += [server.stop, lambda: grpc_server.stop(0), engine.close]
        print(f"ready {engine.epoch} 127.0.0.1:{port}", flush=True)
    else:
        raise SystemExit(f"unknown server kind {kind!r}")
    signal.sigwait([signal.SIGTERM])
    for stop in stops:
        stop()


class _Child:
    def __init__(self, kind: str, path: str, linger_s: float = 1.0):
        cmd = [sys.executable, "-m", "pegaflow.bench.transport_rtt", "--serve", kind, path, str(linger_s)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
        self.ready = self.proc.stdout.readline().decode().split()
        if not self.ready or self.ready[0] != "ready":
            self.close()
            raise RuntimeError(f"{kind} server did not start")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc.stdout.close()


# ------------------------------------------------------------------ the client side


def _timed(call, calls: int, warmup: int = 200) -> list[float]:
    for _ in range(warmup):
        call()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def _stats(samples: list[float]) -> dict:
    xs = sorted(samples)
    n = len(xs)
    return {
        "p50_us": xs[n // 2] * 1e6,
        "p99_us": xs[min(n - 1, int(n * 0.99))] * 1e6,
        "max_us": xs[-1] * 1e6,
        "mean_us": statistics.fmean(xs) * 1e6,
    }


def _local_rpc_scenarios(tmp: str, linger_s: float, calls: int, suffix: str) -> dict:
    import grpc

    from pegaflow.client.local_rpc import LocalRpcClient
    from pegaflow.proto import pegaflow_pb2 as pb
    from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc

    path = os.path.join(tmp, f"rpc{suffix}.sock")
    child = _Child("local-rpc", path, linger_s)
    out = {}
    try:
        epoch, addr = child.ready[1], child.ready[2]
        client = LocalRpcClient(path, epoch)
        req = pb.ReleaseLeaseRequest(session_id="s-bench", lease_id="l-x")

        def local() -> None:
            try:
                client.call("ReleaseLease", req, time.monotonic() + 5)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.NOT_FOUND, err

        out[f"local_rpc_release_notfound{suffix}"] = _timed(local, calls)
        assert client.call_counts()["ReleaseLease"] > calls, "the calls did not travel over the socket"
        client.close()
        if not suffix:
            channel = grpc.insecure_channel(addr)
            stub = pb_grpc.EngineStub(channel)

            def over_grpc() -> None:
                try:
                    stub.ReleaseLease(req, timeout=5)
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.NOT_FOUND, err

            out["grpc_release_notfound"] = _timed(over_grpc, max(calls // 3, 300))
            channel.close()
    finally:
        child.close()
    return out


def _doorbell_scenarios(tmp: str, linger_s: float, calls: int, suffix: str) -> dict:
    from pegaflow.client.doorbell import OP_SAVE, DoorbellClient

    path = os.path.join(tmp, f"bell{suffix}.sock")
    child = _Child("doorbell", path, linger_s)
    out = {}
    try:
        client = DoorbellClient(path, "bench")
        hashes = [os.urandom(16) for _ in range(256)]
        for n in (1, 256):
            hs, ids = hashes[:n], list(range(n))

            def save(hs=hs, ids=ids) -> None:
                assert client.call(OP_SAVE, "s-1", "g-1", hs, ids, time.monotonic() + 5) is not None

            out[f"doorbell_save_{n}{suffix}"] = _timed(save, calls)
        client.close()
    finally:
        child.close()
    return out


def _raw_scenario(tmp: str, calls: int) -> dict:
    path = os.path.join(tmp, "raw.sock")
    child = _Child("raw", path)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 10
        while True:
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        payload = b"x" * 64

        def ping() -> None:
            sock.sendall(payload)
            got = 0
            while got < 64:
                got += len(sock.recv(64 - got))

        out = {"raw_unix_pingpong": _timed(ping, calls)}
        sock.close()
    finally:
        child.close()
    return out


def run(calls: int, runs: int) -> dict:
    from pegaflow.bench.harness.results import machine_info

    per_run: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="rtt-", dir="/tmp") as tmp:
        for r in range(runs):
            found = {}
            found.update(_raw_scenario(tmp, calls))
            found.update(_local_rpc_scenarios(tmp, 1.0, calls, ""))
            found.update(_doorbell_scenarios(tmp, 1.0, calls, ""))
            found.update(_local_rpc_scenarios(tmp, 0.0, calls, "_linger0"))
            found.update(_doorbell_scenarios(tmp, 0.0, calls, "_linger0"))
            for name, samples in found.items():
                per_run.setdefault(name, []).append(_stats(samples))
            print(
                f"run {r + 1}/{runs}: " + ", ".join(f"{k} {v[-1]['p50_us']:.0f}" for k, v in per_run.items())
            )
    scenarios = {}
    for name, results in per_run.items():
        p50s = [x["p50_us"] for x in results]
        p99s = [x["p99_us"] for x in results]
        scenarios[name] = {
            "runs": results,
            "p50_us_median_run": statistics.median(p50s),
            "p50_us_worst_run": max(p50s),
            "p99_us_median_run": statistics.median(p99s),
            "p99_us_worst_run": max(p99s),
        }
    return {"calls_per_run": calls, "runs": runs, "machine": machine_info(), "scenarios": scenarios}


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["scenarios"])
    sc = report["scenarios"]
    fig, ax = plt.subplots(figsize=(11, 5))
    x = range(len(names))
    p50 = [sc[n]["p50_us_median_run"] for n in names]
    p50w = [sc[n]["p50_us_worst_run"] - sc[n]["p50_us_median_run"] for n in names]
    p99 = [sc[n]["p99_us_median_run"] for n in names]
    p99w = [sc[n]["p99_us_worst_run"] - sc[n]["p99_us_median_run"] for n in names]
    ax.bar(
        [i - 0.2 for i in x], p50, 0.4, yerr=[[0] * len(names), p50w], label="p50 (median run, bar to worst)"
    )
    ax.bar(
        [i + 0.2 for i in x], p99, 0.4, yerr=[[0] * len(names), p99w], label="p99 (median run, bar to worst)"
    )
    for i, v in enumerate(p50):
        ax.text(i - 0.2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("round trip (us)")
    ax.set_yscale("log")
    ax.set_title(
        f"local transports, one client thread, {report['calls_per_run']} calls x {report['runs']} runs"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "transport_rtt")
    parser.add_argument("--serve", nargs=3, metavar=("KIND", "PATH", "LINGER_S"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        kind, path, linger = args.serve
        _serve(kind, path, float(linger))
        return
    from pegaflow.bench.harness.results import write_json

    report = run(args.calls, args.runs)
    write_json(args.out.with_suffix(".json"), report)
    plot(report, args.out.with_suffix(".png"))
    print(
        json.dumps(
            {k: {m: round(v[m]) for m in v if m.endswith("run")} for k, v in report["scenarios"].items()}
        )
    )


if __name__ == "__main__":
    main()
