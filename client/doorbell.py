"""The client end of the doorbell, the GPU workers' fast local path for SaveFromDevice / LoadToDevice.

The wire format, and why the doorbell has a codec of its own, are in
``pegaflow.common.wire.doorbell``; connections, deadlines, the greeting's epoch check and the
rules that never run a request twice are the shared ``FrameLink`` (client/frame_link.py). An
answer is what the RPC would answer: the value, or a ``LocalRpcError`` carrying the same status,
details and NOT_FOUND kind, which the client maps with the function it uses for gRPC errors.
"""

from __future__ import annotations

import time

import grpc

from pegaflow.client.frame_link import FrameLink, LinkFailed, LocalRpcError, NotSent
from pegaflow.common.wire import doorbell as wire
from pegaflow.common.wire import status
from pegaflow.common.wire.frames import FrameError
from pegaflow.common.wire.status import NOT_FOUND_METADATA_KEY

OP_SAVE, OP_LOAD = wire.OP_SAVE, wire.OP_LOAD
METHODS = wire.METHODS  # op -> the RPC it stands for
# The caller waits for a GPU copy (milliseconds): it polls hot, without yielding, for up to this long
# before sleeping in the kernel; on the GPU host we measured, a wake-up cost several hundred
# microseconds, a few percent of a 10 ms copy, and the caller waits for this answer anyway.
SPIN_S = 0.05
# The longest answer: its statuses (u8 each), message and kind.
_MAX_ANSWER_BYTES = 64 + wire.MAX_MESSAGE_BYTES + 256 + wire.MAX_BLOCKS


class DoorbellClient:
    """One session's doorbell at ``path`` (the server greets with the session's pool ``epoch``)."""

    def __init__(self, path: str, epoch: str, spin_s: float = SPIN_S):
        self._link = FrameLink(
            path,
            wire.HELLO_MAGIC,
            wire.VERSION,
            epoch,
            _MAX_ANSWER_BYTES,
            spin_s,
            yield_cpu=False,
            what="GPU doorbell",
        )

    @property
    def path(self) -> str:
        return self._link.path

    @property
    def usable(self) -> bool:
        return self._link.usable

    def call(
        self,
        op: int,
        session_id: str,
        registration_id: str,
        hashes,
        block_ids,
        deadline: float,
        purpose: int = 0,
    ) -> tuple[int, list[int]] | None:
        """(value, statuses): blocks written and the save's per-hash statuses, or the blocks loaded.

        None: not sent (use the RPC) - the doorbell is unusable, or the frame cannot carry this
        request (the RPC then answers it, with the RPC's own errors). Raises LocalRpcError.
        """
        if not self._link.usable:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        try:
            frame = wire.encode_request(op, session_id, registration_id, hashes, block_ids, left, purpose)
        except ValueError:  # the frame cannot carry it: not sent, the RPC answers it
            return None
        try:
            answer = wire.decode_response(self._link.call(frame, deadline))
        except NotSent:
            return None
        except TimeoutError:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except (LinkFailed, FrameError) as exc:
            # Sent, so it may have run: the caller must not send it again over gRPC.
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        if answer.not_executed:
            self._link.rest(f"the server did not run {wire.METHODS[op]}: {answer.message}")
            return None
        code = status.from_number(answer.code)
        if code != grpc.StatusCode.OK:
            metadata = ((NOT_FOUND_METADATA_KEY, answer.not_found_kind),) if answer.not_found_kind else ()
            raise LocalRpcError(code, answer.message, metadata)
        return answer.value, answer.statuses

    def close(self) -> None:
        self._link.close()
