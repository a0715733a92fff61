"""The shared value types carry exactly the proto's numbers, so they go on the wire as is."""

from pegaflow.common.wire.types import AllocStatus, QueryPurpose, Tier
from pegaflow.proto import pegaflow_pb2 as pb


def _proto_values(enum_name: str, prefix: str) -> dict[str, int]:
    values = pb.DESCRIPTOR.enum_types_by_name[enum_name].values
    return {v.name.removeprefix(prefix): v.number for v in values if not v.name.endswith("UNSPECIFIED")}


def test_alloc_status_numbers_match_the_proto():
    assert {s.name: s.value for s in AllocStatus} == _proto_values("AllocStatus", "ALLOC_")


def test_tier_numbers_match_the_proto():
    assert {t.name: t.value for t in Tier} == _proto_values("Tier", "TIER_")


def test_query_purpose_numbers_match_the_proto():
    assert {p.name: p.value for p in QueryPurpose} == _proto_values("QueryPurpose", "PURPOSE_")


def test_the_client_and_the_server_use_the_one_definition():
    from pegaflow.client import types as client_types
    from pegaflow.server import engine

    assert client_types.AllocStatus is engine.AllocStatus is AllocStatus
    assert client_types.Tier is Tier
    assert client_types.QueryPurpose is engine.QueryPurpose is QueryPurpose
