"""A real pegaflow-server process for the experiments: `pegaflow.server.testing.ServerProcess`
(own process group, free ports, ready when it prints its JSON "ready" line, which comes after the
pool is allocated and pre-faulted) plus what the experiments measure: seconds from launch to
ready, GetStats as plain values, memory of the process."""

from __future__ import annotations

import pathlib
import socket
import time
from collections.abc import Mapping, Sequence

import grpc
from google.protobuf.descriptor import FieldDescriptor

from pegaflow.bench.harness.procs import tree_cpu_seconds, tree_memory
from pegaflow.proto import pegaflow_pb2, pegaflow_pb2_grpc
from pegaflow.server.testing import ServerProcess

STATS_TIMEOUT_S = 10.0


class PegaflowServerProcess:
    def __init__(
        self,
        pool_size_bytes: int,
        run_dir: pathlib.Path,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        name: str = "pegaflow-server",
        ready_timeout_s: float = 600.0,
    ):
        if pool_size_bytes <= 0:
            raise ValueError(f"pool_size_bytes must be > 0, got {pool_size_bytes}")
        self.pool_size_bytes = pool_size_bytes
        self.server = ServerProcess(
            run_dir / name,
            pool_size=f"{pool_size_bytes}b",
            extra_args=tuple(extra_args),
            start_timeout_s=ready_timeout_s,
            env=dict(env) if env is not None else None,
        )
        self.ready_s: float | None = None

    @property
    def addr(self) -> str:
        """gRPC "host:port", for the connector's server_addr."""
        return self.server.addr

    @property
    def ready_info(self) -> dict:
        return self.server.ready

    def start(self) -> float:
        """Starts the server and waits until it is ready; returns seconds from launch to ready."""
        t0 = time.monotonic()
        self.server.start()
        self.ready_s = time.monotonic() - t0
        return self.ready_s

    def stats(self) -> dict:
        return get_stats(self.addr)

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.server.proc.pid) if self.server.alive() else 0.0

    def memory(self) -> dict:
        return tree_memory(self.server.proc.pid) if self.server.alive() else {}

    def stop(self) -> int | None:
        return self.server.stop(timeout_s=20.0)

    def __enter__(self) -> PegaflowServerProcess:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()


def get_stats(addr: str) -> dict:
    """GetStats of the engine at addr (a pegaflow-server, or an embedded engine's gRPC service) as
    plain values, field names as in the proto, hll_ceiling and measured_hit_rate per window."""
    with grpc.insecure_channel(addr) as channel:
        stub = pegaflow_pb2_grpc.EngineStub(channel)
        resp = stub.GetStats(pegaflow_pb2.GetStatsRequest(), timeout=STATS_TIMEOUT_S)
    return message_to_plain(resp)


def free_local_addr() -> str:
    """ "127.0.0.1:<port>" with a port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def message_to_plain(msg) -> dict:
    """A protobuf message as plain Python values: ints stay ints (json_format would turn 64-bit
    ints into strings), maps become dicts, repeated fields lists."""
    out = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                out[field.name] = {k: message_to_plain(v) for k, v in value.items()}
            else:
                out[field.name] = dict(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if _is_repeated(field):
                out[field.name] = [message_to_plain(v) for v in value]
            else:
                out[field.name] = message_to_plain(value)
        elif _is_repeated(field):
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


def _is_repeated(field) -> bool:
    # protobuf >= 5 exposes is_repeated; `label` is deprecated there.
    is_repeated = getattr(field, "is_repeated", None)
    return bool(is_repeated) if is_repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED
