"""The four GPU RPCs against a real server with no GPU data path (CPU CI): clear refusals, server stays up."""

from __future__ import annotations

import pytest

from pegaflow.client import KvLayout, PegaClient, QueryPurpose, errors
from pegaflow.client.device import DeviceHandle
from pegaflow.server.config import ServerConfig
from pegaflow.server.gpu.copy_plan import Segment
from pegaflow.server.gpu.registration import DeviceRegistration, ExportedTensor
from pegaflow.server.runtime import start_server

REG = DeviceRegistration(
    device_uuid="00112233445566778899aabbccddeeff",
    tensors=(ExportedTensor(bytes(64), 0, 64 * 100),),
    segments=(Segment(0, 0, 64, 64),),
    num_blocks=100,
)


@pytest.fixture
def client():
    # gpu_copy_mode "off" makes this independent of whether the test machine has a GPU.
    srv = start_server(
        ServerConfig(pool_size_bytes=64 << 20, addr="127.0.0.1:0", http_addr=None, gpu_copy_mode="off")
    )
    c = PegaClient(srv.address, timeout_s=10.0, name="gpu-rpc-test")
    try:
        c.connect()
        yield c, c.register_instance(KvLayout(model_id="m", block_bytes=64))
    finally:
        c.close()
        srv.stop()


def test_registration_is_refused_with_a_clear_reason(client):
    c, inst = client
    with pytest.raises(errors.ServerError, match="no GPU data path"):
        c.register_device_memory(inst, REG)
    assert c.stats().live_instances == 1  # the server is still serving


def test_malformed_registrations_are_invalid_arguments_first(client):
    c, inst = client
    bad = DeviceRegistration(REG.device_uuid, (ExportedTensor(bytes(10), 0, 6400),), REG.segments, 100)
    with pytest.raises(errors.InvalidArgument, match="ipc_handle"):
        c.register_device_memory(inst, bad)
    with pytest.raises(errors.InvalidArgument, match="segments"):
        c.register_device_memory(inst, DeviceRegistration(REG.device_uuid, REG.tensors, (), 100))


def test_saves_and_loads_on_an_unknown_registration_are_refused(client):
    c, inst = client
    handle = DeviceHandle(inst, REG)
    handle._set("g-never-registered")
    with pytest.raises(errors.ServerError, match="no GPU data path"):
        c.save_from_device(handle, [b"a", b"b"], [1, 2])
    with pytest.raises(errors.ServerError, match="no GPU data path"):
        c.load_to_device(handle, [b"a"], [1])
    with pytest.raises(errors.ServerError, match="no GPU data path"):
        c.load_to_device(handle, [b"a"], [1], purpose=QueryPurpose.LOAD)
    with pytest.raises(errors.InvalidArgument):
        c.save_from_device(handle, [b"a", b"b"], [1])  # counts differ
    unregistered = DeviceHandle(inst, REG)
    with pytest.raises(errors.ServerUnavailable, match="not registered"):
        c.save_from_device(unregistered, [b"a"], [1])
