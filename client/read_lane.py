"""The client end of the server's read lane (its wire format, and why it exists: common/wire/read_lane.py).

``ReadLaneClient`` belongs to one session (``Connection``): it sends a prefix query (with its lease)
or a lane lease's release over the session's ``FrameLink`` (client/frame_link.py: connections,
deadlines, the greeting's epoch check, never a request run twice) and decodes the answer. What the
caller gets matches the RPC it stands for: a ``PrefixHit`` / None for "done", a ``LocalRpcError``
carrying the status gRPC would carry, or ``NOT_RUN``: the lane did nothing (its socket is unusable,
or the call is one it leaves to the engine: an unknown instance, a chain beyond DRAM, ...), and the
caller sends the call to the engine instead (local RPC socket or gRPC), which answers it fully.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from itertools import repeat

import grpc

from pegaflow.client.frame_link import FrameLink, LinkFailed, LocalRpcError, NotSent
from pegaflow.client.types import Location, PrefixHit, Tier
from pegaflow.common.wire import read_lane as wire
from pegaflow.common.wire import status
from pegaflow.common.wire.frames import FrameError
from pegaflow.common.wire.status import NOT_FOUND_METADATA_KEY

# As the local RPC socket's: most answers come within a millisecond, and a sleeping thread's wake-up
# costs ~50-70 us on the 2-vCPU VMs; the poll yields the CPU each turn.
SPIN_S = 0.001
NOT_RUN = object()  # the lane did not run the call: send it to the engine


class ReadLaneClient:
    def __init__(self, path: str, epoch: str, max_hashes: int, spin_s: float = SPIN_S):
        self.max_hashes = min(max_hashes, wire.MAX_HASHES)
        self._link = FrameLink(
            path,
            wire.HELLO_MAGIC,
            wire.VERSION,
            epoch,
            wire.max_response_bytes(self.max_hashes),
            spin_s,
            yield_cpu=True,
            what="read lane socket",
        )
        self.served = 0  # calls the lane answered (tests and benchmarks read it)

    @property
    def usable(self) -> bool:
        return self._link.usable

    @property
    def epoch(self) -> str:
        return self._link.epoch

    def query(
        self,
        session_id: str,
        instance_id: str,
        hashes: Sequence[bytes],
        lease_id: int,
        lease_ttl_s: float | None,
        load: bool,
        deadline: float,
        held_s: float = 0.0,
    ):
        """A ``PrefixHit``, or NOT_RUN. ``lease_id``: the caller's ``new_lease_id()`` to take a lease
        under (so it can release it if the call times out), 0 for none. Raises LocalRpcError (the
        RPC's status, or UNAVAILABLE when the connection failed after the request went out: it may
        have run, and is not sent again). ``held_s``: FrameLink.call's."""
        if len(hashes) > self.max_hashes or not self._link.usable:
            return NOT_RUN
        lease = lease_id != 0
        try:
            frame = wire.encode_query(
                session_id,
                instance_id,
                list(hashes),
                lease_id=lease_id,
                lease_ttl_ms=int(lease_ttl_s * 1000) if lease_ttl_s else 0,
                purpose_load=load,
                timeout_ms=self._timeout_ms(deadline),
            )
        except ValueError:  # the frame cannot carry it (a long hash, a long id): the engine answers it
            return NOT_RUN
        answer = self._call(frame, deadline, held_s)
        if answer is NOT_RUN:
            return NOT_RUN
        n = len(answer.offsets)
        self.served += 1
        return PrefixHit(
            num_hits=n,
            lease_id=wire.lease_name(lease_id) if lease and n else "",
            locations=list(
                map(
                    tuple.__new__,
                    repeat(Location),
                    zip(answer.offsets, repeat(answer.block_bytes), repeat(Tier.DRAM), answer.checksums),
                )
            ),
            epoch=self._link.epoch,
            sources=(Tier.DRAM,) * n,
        )

    @staticmethod
    def new_lease_id() -> int:
        """A fresh, unguessable lease id (never 0 or 1, which the lane reserves)."""
        return secrets.randbits(64) | (1 << 63)

    def release(self, session_id: str, lease_id: int, loaded_bytes: int, deadline: float):
        """None once released, or NOT_RUN. Raises LocalRpcError (NOT_FOUND for an unknown lease)."""
        if not self._link.usable:
            return NOT_RUN
        frame = wire.encode_release(session_id, lease_id, loaded_bytes, timeout_ms=self._timeout_ms(deadline))
        if self._call(frame, deadline) is NOT_RUN:
            return NOT_RUN
        self.served += 1
        return None

    def _call(self, frame: bytes, deadline: float, held_s: float = 0.0):
        try:
            answer = wire.decode_response(self._link.call(frame, deadline, held_s))
        except NotSent:
            return NOT_RUN
        except TimeoutError:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except (LinkFailed, FrameError) as exc:
            # Sent, so it may have run: the caller must not send it again elsewhere.
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        if answer.not_executed:
            return NOT_RUN  # routine (the engine's call to answer): the lane stays in use
        code = status.from_number(answer.code)
        if code != grpc.StatusCode.OK:
            metadata = ((NOT_FOUND_METADATA_KEY, answer.not_found_kind),) if answer.not_found_kind else ()
            raise LocalRpcError(code, answer.message, metadata)
        return answer

    @staticmethod
    def _timeout_ms(deadline: float) -> int:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return max(int(left * 1000), 1)

    def close(self) -> None:
        self._link.close()
