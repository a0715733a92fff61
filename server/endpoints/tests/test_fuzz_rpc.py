"""Every RPC of the Engine service, fuzzed over gRPC and over the local RPC socket (issue 12 item 8).

Requests are either arbitrary bytes or well-formed messages with hostile field values (built from
the service's descriptors, so a new RPC or field is fuzzed without editing this file; ids are
sometimes a live session's). A run fails on INTERNAL or UNKNOWN (a bug behind the error mapping),
on a hang (every call has a deadline; DEADLINE_EXCEEDED means the server did not answer in time),
on bytes that do not parse being answered differently by the two transports, and on a server that
is no longer healthy afterwards. Bounded: a few hundred examples per transport, well under a minute.
"""

from __future__ import annotations

import socket
import time

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pegaflow.client import PegaClient
from pegaflow.common.wire import frames
from pegaflow.common.wire import local_rpc as wire
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.server.endpoints.tests.support import LAYOUT, connect_raw, remove_stale_sockets
from pegaflow.server.testing import ServerProcess

pytestmark = pytest.mark.timeout(300)
SERVICE = pb.DESCRIPTOR.services_by_name["Engine"]
METHODS = [m.name for m in SERVICE.methods]
CALL_TIMEOUT_S = 5.0  # an answer later than this is a hang
EXAMPLES = 250
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
FIELD = pb_descriptor.FieldDescriptor
LIVE_IDS = ("session_id", "instance_id")  # fields filled mostly with the fuzzing session's own ids
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class Target:
    """A live server, a live session and instance in it, and the two ways to send it raw requests."""

    def __init__(self, srv: ServerProcess):
        self.srv = srv
        self.client = PegaClient(srv.addr, timeout_s=10.0, name="fuzz", local_rpc=False)
        self.client.connect()
        self.session_id = self.client.session_id
        self.instance_id = self.client.register_instance(LAYOUT).instance_id
        self.socket_path = srv.ready["local_rpc_socket_path"]
        self.channel = grpc.insecure_channel(srv.addr)
        self._sock: socket.socket | None = None

    def over_grpc(self, method: str, payload: bytes) -> grpc.StatusCode:
        call = self.channel.unary_unary(f"/{SERVICE.full_name}/{method}")  # bytes in, bytes out
        try:
            call(payload, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    def over_local_socket(self, method: str, payload: bytes) -> grpc.StatusCode:
        if self._sock is None:
            self._sock = connect_raw(self.socket_path, CALL_TIMEOUT_S)
            frames.read_hello(self._sock, time.monotonic() + CALL_TIMEOUT_S)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        try:
            self._sock.sendall(wire.encode_request(method, payload, CALL_TIMEOUT_S))
            body = frames.read_frame(self._sock, wire.max_frame_bytes(8 << 20), deadline)
        except TimeoutError:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        assert body, f"{method}: the server closed the connection on a well-framed request"
        return wire.decode_response(body).code

    def healthy(self) -> bool:
        stub = health_pb2_grpc.HealthStub(self.channel)
        status = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE.full_name), timeout=10).status
        return self.srv.alive() and status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self.channel.close()
        self.client.close()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("fuzz"), pool_size="64mb").start()
    t = Target(srv)
    try:
        yield t
        assert t.healthy()
        assert t.client.stats(timeout_s=10).epoch == srv.epoch  # the engine still answers
    finally:
        t.close()
        srv.kill()
        remove_stale_sockets(srv)


# ------------------------------------------------------------------ requests from the descriptors


def _scalar(field, target: Target):
    name = field.name
    if field.type == FIELD.TYPE_STRING:
        text = st.text(max_size=80)
        if name in LIVE_IDS:  # mostly the live ones, so that calls get past the id checks
            live = st.just(getattr(target, name))
            return st.one_of(live, live, live, text)
        return st.one_of(text, st.text(min_size=60, max_size=300))
    if field.type == FIELD.TYPE_BYTES:  # mostly valid block hashes (1..64 bytes), sometimes not
        return st.one_of(
            st.binary(min_size=1, max_size=64), st.binary(min_size=1, max_size=16), st.binary(max_size=300)
        )
    if field.type in (FIELD.TYPE_UINT32, FIELD.TYPE_FIXED32):
        return st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1))
    if field.type in (FIELD.TYPE_UINT64, FIELD.TYPE_FIXED64):
        return st.one_of(
            st.integers(0, 64), st.sampled_from([2**32, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1)
        )
    if field.type in (FIELD.TYPE_INT32, FIELD.TYPE_SINT32, FIELD.TYPE_SFIXED32, FIELD.TYPE_ENUM):
        return st.integers(-(2**31), 2**31 - 1) if field.type != FIELD.TYPE_ENUM else st.integers(-3, 8)
    if field.type in (FIELD.TYPE_INT64, FIELD.TYPE_SINT64, FIELD.TYPE_SFIXED64):
        return st.integers(-(2**63), 2**63 - 1)
    if field.type == FIELD.TYPE_BOOL:
        return st.booleans()
    if field.type in (FIELD.TYPE_DOUBLE, FIELD.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    raise AssertionError(f"no strategy for field {field.full_name} of type {field.type}")


def message(descriptor, target: Target, depth: int = 0):
    """A strategy for messages of ``descriptor``: any subset of fields, hostile values."""
    cls = message_factory.GetMessageClass(descriptor)
    parts, always = {}, {}
    for field in descriptor.fields:
        if field.type == FIELD.TYPE_MESSAGE:
            if depth >= 2:
                continue
            one = message(field.message_type, target, depth + 1)
        else:
            one = _scalar(field, target)
        if field.is_repeated:
            many = st.lists(one, max_size=12)
            if field.type == FIELD.TYPE_BYTES:  # mostly a batch, sometimes past the server's limit
                some = st.lists(one, min_size=1, max_size=12)
                past = st.integers(4097, 4200).map(lambda n: [b"h%d" % i for i in range(n)])
                always[field.name] = st.one_of(some, some, some, many, past)
                continue
            parts[field.name] = many
        else:
            (always if field.name in LIVE_IDS else parts)[field.name] = one

    def build(values: dict):
        msg = cls()
        for name, value in values.items():
            field = descriptor.fields_by_name[name]
            if field.is_repeated:
                getattr(msg, name).extend(value)
            elif field.type == FIELD.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries(always, optional=parts).map(build)


@st.composite
def requests(draw, target: Target, methods=tuple(METHODS)):
    method = draw(st.sampled_from(methods))
    # CloseSession / UnregisterInstance of the live ids would end the fuzzing session's coverage.
    if method in ("CloseSession", "UnregisterInstance") or draw(st.integers(0, 3)) == 0:
        return method, draw(st.binary(max_size=400)), True
    input_type = SERVICE.methods_by_name[method].input_type
    return method, draw(message(input_type, target)).SerializeToString(), False


# ------------------------------------------------------------------ the two transports


def _undecodable(method: str, payload: bytes) -> bool:
    cls = message_factory.GetMessageClass(SERVICE.methods_by_name[method].input_type)
    try:
        cls.FromString(payload)
    except Exception:
        return True
    return False


def test_no_request_over_grpc_gets_internal_hangs_or_kills_the_server(target):
    @FUZZ_SETTINGS
    @given(st.data())
    def run(data):
        method, payload, _ = data.draw(requests(target))
        code = target.over_grpc(method, payload)
        assert code not in BAD_CODES, (method, payload, code)
        if _undecodable(method, payload):
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, payload, code)

    run()
    assert target.healthy()


def test_no_request_over_the_local_socket_gets_internal_hangs_or_kills_the_server(target):
    @FUZZ_SETTINGS
    @given(st.data())
    def run(data):
        method, payload, raw = data.draw(requests(target))
        code = target.over_local_socket(method, payload)
        assert code not in BAD_CODES, (method, payload, code)
        if method not in wire.LOCAL_METHODS:
            assert code == grpc.StatusCode.UNIMPLEMENTED  # not run; the client sends those over gRPC
        elif _undecodable(method, payload):
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, payload, code)
            assert target.over_grpc(method, payload) == code  # the same answer on both transports

    run()
    assert target.healthy()
