"""The frontier benchmark reads what the builds report: every row's figures from its build's report.json, the served
score's AUROC per kind of OOD set, and Hydra's verdict against each row over paired seeds."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks import frontier, frontier_tables
from offline.build import build
from offline.config import load_config
from tests.offline.conftest import ticket_build, write_user_files


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two seeds of a tiny text build with the baselines, laid out as the recipe benchmark's work folder."""
    root = tmp_path_factory.mktemp("frontier")
    ckpt, tickets = write_user_files(root)
    (root / "near-chat.txt").write_text("".join(f"hello there, how are you on day {i}\n" for i in range(40)))
    (root / "far-weather.txt").write_text("".join(f"rain and wind over the hills on day {i}\n" for i in range(40)))
    work = root / "work" / "text-fast"
    for seed in (0, 1):
        over = ticket_build(
            ckpt,
            tickets,
            **{
                "base.baselines": ["lora_ensemble", "laplace"],
                "data.seed": seed,
                "data.shift_inputs": 8,
                "data.shift_severities": [1, 5],
                "data.ood_paths": {
                    "near-chat": str(root / "near-chat.txt"),
                    "far-weather": str(root / "far-weather.txt"),
                },
            },
        )
        build(load_config(None, over), work / ("baselines" if seed == 0 else f"baselines@seed{seed}"))
    return root / "work"


def test_rows_are_the_builds_own_figures(builds, monkeypatch):
    monkeypatch.setattr(frontier, "WORK", builds)
    rows = frontier.collect("text", keep=False)
    assert set(rows) == {"Single", "Single + Laplace (last layer)", "LoRA-Ensemble", "Hydra, k = 0"}
    assert [f["seed"] for f in rows["Single"]] == [0, 1]
    report = json.loads((builds / "text-fast" / "baselines@seed1" / "report.json").read_text())
    lora = next(r for r in report["rows"] if r["method"] == "lora_ensemble")
    got = rows["LoRA-Ensemble"][1]
    assert got["acc"] == lora["acc"] and got["ece_ts"] == lora["calibrated"]["ece"]
    served = got["served_score"]
    per_set = lora["ood_scores"][served]["ood"]
    assert got["auroc_served_near"] == per_set["near-chat"]["auroc"]
    assert got["auroc_served_far"] == per_set["far-weather"]["auroc"]
    text = frontier_tables.markdown("text", rows, None, "a machine")
    assert "| LoRA-Ensemble | 0, 1 |" in text
    assert text.count("Each Hydra row against each other row") == 1
    # the verdict columns: Hydra against Single on the served AUROC, over the 2 paired seeds
    line = next(line for line in text.splitlines() if line.startswith("| Hydra, k = 0 | Single |"))
    assert any(v in line for v in ("win", "tie", "loss"))
    # under shift: each row's figures are its build's shift summary, at both severities
    shift = report["extra"]["shift"]["methods"]["lora_ensemble"]["summary"]
    assert got["shift"]["mean"]["brier"] == shift["mean"]["brier"] and set(got["shift"]) == {"mean", "1", "5"}
    under = text[text.index("Under shift: ") :]
    assert "acc % / Brier @1 | acc % / Brier @5" in under
    acc = 100 * statistics.mean(f["shift"]["mean"]["acc"] for f in rows["LoRA-Ensemble"])
    assert f"| LoRA-Ensemble | 0, 1 | {acc:.1f} ±" in under
    assert "| Hydra, k = 0 | LoRA-Ensemble |" in under


def test_a_seed_without_its_build_keeps_its_committed_figures(builds, monkeypatch, tmp_path):
    """A fresh machine has none of the earlier builds: a (row, seed) they gave keeps its committed figures, marked in
    the table, and a build in the work folder wins over them."""
    monkeypatch.setattr(frontier, "WORK", builds)
    monkeypatch.setattr(frontier, "OUT", tmp_path)
    fresh = frontier.collect("text", keep=False)
    kept_single = {**fresh["Single"][0], "seed": 2, "acc": 0.123}
    stale_single = {**fresh["Single"][0], "acc": 0.999}  # seed 0 again: its build is there, so it is not kept
    trunk = {**fresh["Hydra, k = 0"][0], "seed": 1}
    committed = {"rows": {"Single": [stale_single, kept_single], "Hydra, trunk k = 3L/4": [trunk]}}
    (tmp_path / "text.json").write_text(json.dumps(committed))
    rows = frontier.collect("text")
    assert [(f["seed"], f.get("kept", False)) for f in rows["Single"]] == [(0, False), (1, False), (2, True)]
    assert rows["Single"][0]["acc"] == fresh["Single"][0]["acc"] and rows["Single"][2]["acc"] == 0.123
    assert rows["Hydra, trunk k = 3L/4"] == [{**trunk, "kept": True}]
    assert list(rows)[-1] == "Hydra, trunk k = 3L/4"  # the table's order, whatever the source
    text = frontier_tables.markdown("text", rows, None, "a machine")
    assert "| Single | 0, 1, 2* |" in text and "| Hydra, trunk k = 3L/4 | 1* |" in text
    assert frontier_tables.KEPT_NOTE in text
    assert frontier_tables.KEPT_NOTE not in frontier_tables.markdown("text", fresh, None, "a machine")


def test_the_script_runs_to_its_end(builds, monkeypatch, tmp_path):
    """``python -m benchmarks.frontier`` on the two tiny builds, with one timing round: the tables, the cost measured
    side by side, the plot, and the shipped recipe's figures published into summary.json and tables.md."""
    results = tmp_path / "results"
    monkeypatch.setattr(frontier, "WORK", builds)
    monkeypatch.setattr(frontier, "OUT", results / "frontier")
    monkeypatch.setattr(frontier, "PLOTS", results / "plots")
    monkeypatch.setattr(frontier, "SUMMARY", results / "summary.json")
    monkeypatch.setattr(frontier, "TABLES", results / "tables.md")
    assert frontier.main(["--settings", "text", "--reps", "1"]) == 0
    doc = json.loads((results / "frontier" / "text.json").read_text())
    assert doc["setting"] == "text-fast" and doc["rows"] == frontier.collect("text", keep=False)
    cost = doc["cost"]
    assert cost["_setup"]["reps"] == 1 and cost["Single"]["macs_ratio"] == 1.0
    assert {"LoRA-Ensemble", "BatchEnsemble", "Hydra, k = 0"} <= set(cost)
    assert cost["LoRA-Ensemble"]["macs_ratio"] > 1  # its members, one after another, each the whole base
    for label, c in cost.items():
        if label != "_setup":
            assert c["macs_ratio"] > 0 and c["batch1"]["min_ms"] > 0 and c["batch32"]["min_ms"] > 0
    md = (results / "frontier" / "text.md").read_text()
    assert md == frontier_tables.markdown(
        "text", doc["rows"], cost, doc["machine"], (frontier.REFERENCE, frontier.SHIPPED)
    )
    assert "Chosen by the rule: **" in md
    assert (results / "plots" / "pareto_text.png").stat().st_size > 0
    shipped = json.loads((results / "summary.json").read_text())["shipped"]
    assert shipped["settings"]["text-fast"]["rows"]["Single"]["seeds"] == [0, 1]
    tables = (results / "tables.md").read_text()
    assert tables.startswith(frontier.BEGIN) and frontier.END in tables


def _seeds(**fig: list[float]) -> list[dict]:
    n = len(next(iter(fig.values())))
    return [{"seed": i, **{k: v[i] for k, v in fig.items()}} for i in range(n)]


def test_the_default_rule_ships_the_cheapest_row_that_ties_or_wins_and_says_what_it_gives_up():
    ref = _seeds(acc=[0.80, 0.81, 0.82], auroc_served=[0.90, 0.91, 0.92], aurc=[0.05, 0.05, 0.05], nll_ts=[0.5] * 3)
    cheap_bad = _seeds(acc=[0.70, 0.71, 0.72], auroc_served=[0.90, 0.91, 0.92], aurc=[0.05] * 3, nll_ts=[0.5] * 3)
    mid_ok = _seeds(
        acc=[0.80, 0.81, 0.82],
        auroc_served=[0.91, 0.92, 0.93],
        aurc=[0.05] * 3,
        nll_ts=[0.5] * 3,
        ece_ts=[0.05, 0.06, 0.07],
    )
    for r in ref:
        r["ece_ts"] = 0.03
    rows = {"Hydra, k = 0": ref, "Hydra, trunk a": cheap_bad, "Hydra, trunk b": mid_ok}
    costs = {
        "Hydra, k = 0": {"macs_ratio": 2.2},
        "Hydra, trunk a": {"macs_ratio": 1.1},
        "Hydra, trunk b": {"macs_ratio": 1.4},
    }
    text = "\n".join(frontier_tables.rule_lines(rows, costs, "Hydra, k = 0", "Hydra, trunk b"))
    assert "| Hydra, trunk a | 1.10 |" in text and "loss (-10.00)" in text  # accuracy lost: it does not pass
    line = next(ln for ln in text.splitlines() if ln.startswith("| Hydra, trunk b |"))
    assert "| yes |" in line and "ECE, own T loss (+3.00)" in line  # what the chosen row gives up
    assert text.endswith("Chosen by the rule: **Hydra, trunk b** (the row the configs ship).")


@pytest.mark.parametrize("name", ["image-fast.yaml", "text-fast.yaml"])
def test_the_fast_configs_ship_the_rows_shipped_row(name):
    """The row the frontier marks as shipped is what the fast configs build: the trunk at 3L/4 of the base's
    blocks (read from the base model's own config files)."""
    from benchmarks.recipe import resolve
    from offline.config import load_config

    cfg = load_config(Path(frontier.ROOT) / "offline" / "configs" / name)
    assert frontier.SHIPPED == "Hydra, trunk k = 3L/4"
    assert cfg.hydra.shared_blocks == resolve({"hydra.shared_blocks": "3L/4"}, cfg)["hydra.shared_blocks"] == 4
