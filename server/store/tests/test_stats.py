"""The statistics are defined once (server/store/stats.py): GetStats and the metrics both read it."""

import dataclasses

from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.server.store.stats import EngineStats, metric_fields, scalar_fields
from pegaflow.server.tiers.base import TierStats


def test_every_statistic_is_a_getstats_field_of_the_same_name():
    proto = set(pb.GetStatsResponse.DESCRIPTOR.fields_by_name)
    assert set(scalar_fields()) <= proto


def test_every_tier_statistic_is_a_tierstats_field_of_the_same_name():
    assert {f.name for f in dataclasses.fields(TierStats)} <= set(pb.TierStats.DESCRIPTOR.fields_by_name)


def test_metric_families_sharing_a_name_agree_on_kind_help_and_labels():
    families: dict[str, tuple] = {}
    for f in metric_fields():
        shape = (f.kind, f.doc, tuple(k for k, _ in f.labels))
        assert families.setdefault(f.name, shape) == shape, f.name
    assert len(families) > 30


def test_counters_of_the_store_and_the_clients_are_all_reported():
    from pegaflow.server.store.stats import ClientCounters, StoreCounters

    fields = {f.name for f in dataclasses.fields(EngineStats)}
    assert set(StoreCounters.__slots__) <= fields
    assert set(ClientCounters.__slots__) <= fields
