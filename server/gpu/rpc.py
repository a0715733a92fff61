"""The GPU data path's four RPCs on the server: request message -> GpuDataPath -> response message.

The servicer (server/endpoints/grpc_servicer.py) wraps each ``handle_*`` in its
``_handler`` (deadline, error codes, metrics). Errors are the engine's
(InvalidArgument, NotFound, FailedPrecondition, ...), so they map to the same
status codes as every other call. ``save`` and ``load`` take the fields themselves, so
the doorbell (server/endpoints/doorbell.py) runs the very same checks and calls. The client's
side of the messages is in pegaflow.client.device.
"""

from __future__ import annotations

from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.server.config import ServerConfig
from pegaflow.server.endpoints import validation as check
from pegaflow.server.errors import FailedPrecondition, InvalidArgument
from pegaflow.server.gpu.registration import registration_from_proto

NO_GPU = "this pegaflow-server has no GPU data path (no CUDA device, CuPy missing, or --gpu-copy-mode off)"


def _require(gpu):
    if gpu is None:
        raise FailedPrecondition(NO_GPU)
    return gpu


def _block_ids(ids, hashes: list[bytes]) -> list[int]:
    if len(ids) != len(hashes):
        raise InvalidArgument(f"{len(hashes)} block_hashes but {len(ids)} block_ids")
    return list(ids)


# ------------------------------------------------------------------ server side


def handle_register(gpu, req: pb.RegisterDeviceMemoryRequest, deadline: float):
    session_id = check.ident(req.session_id, "session_id")
    instance_id = check.ident(req.instance_id, "instance_id")
    reg = registration_from_proto(req)
    gpu = _require(gpu)
    reg_id = gpu.register(session_id, instance_id, reg, deadline)
    return pb.RegisterDeviceMemoryResponse(registration_id=reg_id, doorbell_socket_path=gpu.doorbell_path)


def handle_unregister(gpu, req: pb.UnregisterDeviceMemoryRequest, deadline: float):
    _require(gpu).unregister(
        check.ident(req.session_id, "session_id"),
        check.ident(req.registration_id, "registration_id"),
        deadline,
    )
    return pb.UnregisterDeviceMemoryResponse()


def save(
    gpu, session_id: str, registration_id: str, hashes, block_ids, deadline: float, config: ServerConfig
):
    """A SaveFromDevice's checks and call, from its fields: what the RPC and the doorbell both run."""
    session_id = check.ident(session_id, "session_id")
    reg_id = check.ident(registration_id, "registration_id")
    hashes = check.block_hashes(hashes, config)
    block_ids = _block_ids(block_ids, hashes)  # malformed input is INVALID_ARGUMENT on any server
    return _require(gpu).save(session_id, reg_id, hashes, block_ids, deadline)


def load(
    gpu, session_id: str, registration_id: str, hashes, block_ids, purpose: int, deadline: float, config
):
    """A LoadToDevice's checks and call, from its fields: what the RPC and the doorbell both run."""
    session_id = check.ident(session_id, "session_id")
    reg_id = check.ident(registration_id, "registration_id")
    hashes = check.block_hashes(hashes, config)
    block_ids = _block_ids(block_ids, hashes)
    purpose = check.purpose(purpose)
    return _require(gpu).load(session_id, reg_id, hashes, block_ids, deadline, purpose)


def handle_save(gpu, req: pb.SaveFromDeviceRequest, deadline: float, config: ServerConfig):
    out = save(gpu, req.session_id, req.registration_id, req.block_hashes, req.block_ids, deadline, config)
    return pb.SaveFromDeviceResponse(statuses=[int(s) for s in out.statuses], written=out.written)


def handle_load(gpu, req: pb.LoadToDeviceRequest, deadline: float, config: ServerConfig):
    fields = (req.session_id, req.registration_id, req.block_hashes, req.block_ids, req.purpose)
    out = load(gpu, *fields, deadline, config)
    return pb.LoadToDeviceResponse(num_hits=out.num_hits)
