"""The prediction store's benchmarks: ``benchmarks/store_cost.py`` (the store on vs off, paired) and the soak's
``--feedback`` mode. Known answers for their arithmetic; each script end to end on a tiny model (slow: they start
real servers)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import soak, store_cost
from service.store.store import StoreConfig


def test_ratios_pair_rounds_and_report_the_median_and_range():
    rounds = [
        {"on": {"rps": 95.0, "p99_ms": 11.0}, "off": {"rps": 100.0, "p99_ms": 10.0}},
        {"on": {"rps": 99.0, "p99_ms": 10.0}, "off": {"rps": 90.0, "p99_ms": 10.0}},
        {"on": {"rps": 80.0, "p99_ms": 12.0}, "off": {"rps": 100.0, "p99_ms": 8.0}},
    ]
    assert store_cost.ratios(rounds, "rps") == {"median": 0.95, "min": 0.8, "max": 1.1}
    assert store_cost.ratios(rounds, "p99_ms") == {"median": 1.1, "min": 1.0, "max": 1.5}


def test_store_summary_bounds_rows_by_the_cap_plus_one_retention_interval():
    """Rows may pass the cap by what is answered between two retention passes (at the busiest minute's rate) plus
    one writer batch; the bytes' growth is measured from the first sample after the warm-up."""
    args = argparse.Namespace(store_growth=0.1, store_max_rows=20_000)
    post = [
        {"store_bytes": 0, "store_rows": -1},  # not readable yet: left out
        {"store_bytes": 1000, "store_rows": 21_000},
        {"store_bytes": 1080, "store_rows": 30_000},
        {"store_bytes": 1050, "store_rows": 20_500},
    ]
    s = soak._store_summary(post, args, rps=150.0)
    cfg = StoreConfig(url="")
    assert s["bytes_after_warmup"] == 1000 and s["peak_bytes_after_warmup"] == 1080
    assert s["growth_fraction"] == pytest.approx(0.08)
    assert s["peak_rows"] == 30_000
    assert s["rows_bound"] == int(20_000 + 150.0 * cfg.retention_interval_s + cfg.flush_rows)


@pytest.mark.slow
def test_store_cost_end_to_end_on_a_tiny_model(tmp_path: Path):
    out = tmp_path / "store_cost.json"
    store_cost.main(["--tiny", "vit", "--rounds", "2", "--seconds", "2", "--warmup", "50", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert len(doc["rounds"]) == 2 and all(r[m]["requests"] > 0 for r in doc["rounds"] for m in ("on", "off"))
    assert doc["checks"]["no_errors"] and doc["checks"]["no_record_dropped"]
    assert doc["store_records"]["written"] > 0  # the store-on server wrote; the other has none to count


@pytest.mark.slow
def test_soak_with_feedback_labels_every_answer_and_samples_the_store(tmp_path: Path):
    out = tmp_path / "soak.json"
    argv = ["--tiny", "vit", "--minutes", "0.4", "--warmup-minutes", "0.1", "--window-minutes", "0.1"]
    soak.main([*argv, "--sample-s", "2", "--feedback", "--store-max-rows", "1000", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["feedback"] and doc["feedback_by_status"] == {"accepted": doc["requests"]}
    assert doc["checks"]["feedback_accepted"] and doc["store"]["peak_rows"] > 0
    assert all("store_bytes" in s for s in doc["rss_samples"])
