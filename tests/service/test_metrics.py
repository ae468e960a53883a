"""The metrics table: every row is an attribute of Metrics, of the declared type, registered in the table's order."""

from __future__ import annotations

from service.metrics import SPECS, Metrics


def test_every_metric_of_the_table_is_a_typed_attribute_in_order():
    m = Metrics()
    assert set(SPECS) == set(Metrics.__annotations__)
    for attr, spec in SPECS.items():
        assert isinstance(getattr(m, attr), spec.kind), attr
    names = [f.name for f in m.registry.collect()]
    # Prometheus names a counter's family without its _total suffix
    assert names == [s.name.removesuffix("_total") for s in SPECS.values()]
