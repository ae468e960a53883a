"""Benchmarks: known answers for the helpers, the result files' shape, and a slow end-to-end smoke run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import bench_fusion
from benchmarks import cost as cost_mod
from benchmarks import quality as q
from benchmarks import run as run_mod

QUALITY_KEYS = {"setting", "method", "seed", "acc", "nll", "brier", "ece", "aece", "ood", "mi_id", "mi_ood"}
COST_KEYS = {
    "layout",
    "method",
    "batch",
    "device",
    "precision",
    "latency_ms_min",
    "latency_ms_median",
    "params",
    "macs",
}


def test_mean_std_known_answer():
    assert q.mean_std([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1.0))  # sample std (ddof=1)
    assert q.mean_std([0.5]) == (0.5, 0.0)
    m, s = q.mean_std([float("nan"), None])
    assert math.isnan(m) and math.isnan(s)


@pytest.mark.parametrize(("setting", "config"), [("text", "text-full-taylor.yaml"), ("text", "text-full-circuit.yaml")])
def test_full_mode_is_the_builds_full_recipe(tmp_path: Path, setting: str, config: str):
    """The full benchmark's base and member recipe is the full build config's, so the seed-0 base is shared (text;
    the image benchmark trains its bases from scratch, the full image build fine-tunes the pretrained backbone)."""
    from dataclasses import replace

    from offline.config import load_config
    from offline.pipelines.classifier_build import base_checkpoint_dir

    spec = q.setting_spec(setting, fast=False)
    cfg = load_config(Path(q.ROOT) / "offline" / "configs" / config)
    samples = spec.n_circuit if cfg.hydra.strategy.startswith("circuit") else spec.calib_samples
    assert (spec.finetune_steps, samples, spec.prune_per_layer, spec.members) == (
        cfg.hydra.finetune_steps,
        cfg.hydra.calib_samples,
        cfg.hydra.prune_per_layer,
        cfg.hydra.members,
    )
    builder_dir = base_checkpoint_dir(replace(cfg, base=replace(cfg.base, cache_dir=str(tmp_path))), None)
    assert q.builder_base_dir(spec, 0, tmp_path) is None  # nothing cached yet: train in the benchmark's own cache
    builder_dir.mkdir(parents=True)
    assert q.builder_base_dir(spec, 0, tmp_path) == builder_dir
    assert q.builder_base_dir(spec, 1, tmp_path) is None  # the builder trains seed 0 only
    assert q.builder_base_dir(q.setting_spec(setting, fast=True), 0, tmp_path) is None  # another recipe


def test_member_cache_key_ignores_progress_and_adopts_quiet_runs(tmp_path: Path, monkeypatch):
    """A member fine-tuned under --quiet is found by a run with progress bars (its folder is renamed once)."""
    from types import SimpleNamespace

    seen: list[Path] = []
    monkeypatch.setattr(
        q.train_mod, "finetune_member", lambda *a, resume, **k: seen.append(resume.folder) or torch.nn.Identity()
    )
    spec = q.setting_spec("image", fast=True)
    adapter = SimpleNamespace(kept_heads=lambda m: [[0, 1], [2]])

    def ctx(progress: bool):
        return SimpleNamespace(
            spec=spec,
            cache=tmp_path,
            progress=progress,
            adapter=adapter,
            data=None,
            prep=None,
            tok=None,
            cfg=SimpleNamespace(hydra=SimpleNamespace(unfreeze="attention+mlp")),
        )

    q.finetune(ctx(True), torch.nn.Identity(), 0, 1, "m")
    q.finetune(ctx(False), torch.nn.Identity(), 0, 1, "m")
    assert seen[0] == seen[1]  # one key whatever the progress flag
    # a folder made by the old key of a --quiet run (progress=False in the hash) is adopted, not retrained
    tcfg = q._train_config(spec, "finetune", 1, False, steps=spec.finetune_steps, unfreeze="attention+mlp")
    legacy = tmp_path / "members" / q.digest({"base": 0, "heads": [[0, 1], [2]], "train": q.train_mod.recorded(tcfg)})
    assert legacy != seen[0]
    legacy.mkdir(parents=True)
    (legacy / "model-0000040.safetensors").write_bytes(b"x")
    q.finetune(ctx(True), torch.nn.Identity(), 0, 1, "m")  # a run with bars finds the --quiet run's member
    assert seen[2] == seen[0] and (seen[0] / "model-0000040.safetensors").is_file() and not legacy.exists()


def test_count_macs_counts_inplace_gemms():
    x, w, r = torch.randn(4, 8), torch.randn(8, 16), torch.randn(4, 16)
    assert cost_mod.count_macs(lambda: x @ w) == 4 * 8 * 16
    assert cost_mod.count_macs(lambda: r.clone().addmm_(x, w)) == 4 * 8 * 16  # torch's registry alone gives 0
    a, b = torch.randn(2, 4, 8), torch.randn(2, 8, 16)
    assert cost_mod.count_macs(lambda: torch.zeros(2, 4, 16).baddbmm_(a, b)) == 2 * 4 * 8 * 16
    lin = torch.nn.Linear(32, 10)
    assert cost_mod.count_macs(lambda: lin(torch.randn(3, 32))) == 3 * 32 * 10


def test_ratios_known_answer():
    rows = [
        {
            "layout": "x",
            "device": "cpu",
            "precision": "fp32",
            "batch": 1,
            "method": m,
            "latency_ms_min": t,
            "latency_ms_median": 2 * t,
            "params": p,
            "macs": c,
        }
        for m, t, p, c in (("single", 10.0, 100, 50), ("hydra", 12.0, 130, 120), ("deep_ensemble", 30.0, 300, 150))
    ]
    by = {r["method"]: r for r in cost_mod.ratios(rows, "single")}
    assert by["hydra"]["ratio_min"] == pytest.approx(1.2) and by["hydra"]["ratio_median"] == pytest.approx(1.2)
    assert by["deep_ensemble"]["macs_ratio"] == pytest.approx(3.0) and by["single"]["params_ratio"] == 1.0
    to_de = {r["method"]: r for r in cost_mod.ratios(rows, "deep_ensemble")}
    assert to_de["hydra"]["ratio_min"] == pytest.approx(0.4)


def test_fusion_results_never_mix_cpus(tmp_path: Path):
    """Cells timed on a CPU with native bf16 must not join a file timed on one without (3x apart in bf16)."""
    meta = {
        "layout": "bert_base",
        "members": 3,
        "keep": 6,
        "threads": 2,
        "thp": "1",
        "cpu": "Xeon",
        "cpu_bf16": "none",
        "cpu_max_rows": 0,
    }
    bench_fusion.check_mergeable(meta, dict(meta), tmp_path / "f.json")  # same setup: merges
    for key, value in (("cpu_bf16", "avx512_bf16, amx_bf16"), ("cpu", "EPYC"), ("threads", 1), ("cpu_max_rows", 4096)):
        with pytest.raises(SystemExit, match=key):
            bench_fusion.check_mergeable(meta, {**meta, key: value}, tmp_path / "f.json")


def test_mc_dropout_model_turns_dropout_on():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    vit = VisionTransformer(
        img_size=16, patch_size=4, in_chans=1, embed_dim=32, depth=2, num_heads=4, num_classes=3
    ).eval()
    for p in vit.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    mc = q.mc_dropout_model(vit, 0.3)
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        assert torch.equal(vit(x), vit(x))  # the original is untouched and deterministic
        assert not torch.allclose(mc(x), mc(x))  # samples differ
    assert all(m.p == 0 for m in vit.modules() if isinstance(m, torch.nn.Dropout))


def _fake_quality_row(setting: str, method: str, seed: int, auroc: float, ece: float) -> dict:
    ood = {
        "near-set": {"kind": "near", "auroc": auroc, "fpr95": 0.5, "aupr_in": 0.6, "aupr_out": 0.6},
        "far-set": {"kind": "far", "auroc": auroc + 0.1, "fpr95": 0.3, "aupr_in": 0.7, "aupr_out": 0.7},
    }
    return {
        "setting": setting,
        "method": method,
        "seed": seed,
        "acc": 0.9,
        "nll": 0.3,
        "brier": 0.15,
        "ece": ece,
        "aece": ece,
        "ood": ood,
        "mi_id": 0.01,
        "mi_ood": 0.05,
        "disagreement_id": 0.02,
        "disagreement_ood": 0.1,
        "params": 1000,
    }


def test_outputs_merge_and_readme_block(tmp_path: Path):
    out, readme = tmp_path / "results", tmp_path / "README.md"
    out.mkdir()
    readme.write_text(f"# B\n\nintro\n\n{run_mod.BEGIN}\nold tables\n{run_mod.END}\n\n## Reading\nkept\n")
    rows = [_fake_quality_row("image", "single", s, 0.70 + 0.01 * s, 0.05) for s in range(3)]
    rows += [_fake_quality_row("image", "deep_ensemble", 0, 0.75, 0.03)]
    rows += [_fake_quality_row("image", "hydra_taylor", s, 0.80, 0.04) for s in range(3)]
    run_mod.write_part(out, "quality", rows, "setting", {"image"}, {"mode": "fast", "sizes": {"max_train": 1}})
    text_rows = [_fake_quality_row("text", "single", 0, 0.6, 0.1)]
    run_mod.write_part(out, "quality", text_rows, "setting", {"text"}, {"mode": "fast"})
    again = [_fake_quality_row("image", "single", 0, 0.5, 0.2)]  # rerunning image replaces only image rows
    doc = run_mod.write_part(out, "quality", again, "setting", {"image"}, {"mode": "fast"})
    assert [(r["setting"], r["method"]) for r in doc["rows"]] == [("text", "single"), ("image", "single")]
    run_mod.write_part(out, "quality", rows, "setting", {"image"}, {"mode": "fast"})
    summary = run_mod.write_outputs(out, readme, "python -m benchmarks.run --fast")
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["machine"] and on_disk["quality"] == summary["quality"]
    assert all(QUALITY_KEYS <= set(r) for r in on_disk["quality"])
    text = readme.read_text()
    assert "old tables" not in text and "intro" in text and "## Reading\nkept" in text
    assert text.count(run_mod.BEGIN) == 1 and text.count(run_mod.END) == 1
    # Hydra 80 % AUROC (mean of near 80 and far 90 = 85) vs Single mean 71/81 -> met; vs Deep Ensemble 80 -> met
    assert "| Hydra (Taylor) | 3 | 90.0 ± 0.0 |" in text
    assert "| OOD AUROC ≥ Single | AUROC 85.0: met |" in text
    assert "| ECE ≤ Single | ECE 4.0: met |" in text
    assert (out / "plots" / "quality.png").is_file()


def _smoke_context(tmp_path: Path) -> q.Context:
    """Tiny sizes of the image setting, prepared (skips where Fashion-MNIST is not installed)."""
    spec = q.with_spec(
        q.setting_spec("image", fast=True),
        mode="custom",
        sizes={"max_train": 240, "max_val": 48, "max_test": 64, "max_ood": 32},
        calib_samples=16,
        finetune_steps=2,
        base_steps=4,
        ablation_prune=(1,),
        ablation_members=(1, 2),
    )
    torch.set_num_threads(1)
    try:
        return q.prepare(spec, tmp_path / "cache", progress=False)
    except FileNotFoundError as e:
        pytest.skip(f"Fashion-MNIST is not installed here: {e}")


def _check_quality_rows(rows: list[dict]) -> None:
    """Every method, MC Dropout at both sample counts, three Hydra seeds; metrics in range; the Deep Ensemble is the
    three singles."""
    methods = [(r["method"], r.get("samples")) for r in rows]
    for m in q.METHODS:
        assert any(x == m for x, _ in methods), m
    assert {s for m, s in methods if m == "mc_dropout"} == {3, 10}
    assert sorted(r["seed"] for r in rows if r["method"] == "hydra_circ") == [0, 1, 2]
    for r in rows:
        assert QUALITY_KEYS <= set(r)
        for k in ("acc", "ece", "aece"):
            assert 0 <= r[k] <= 1
        for v in r["ood"].values():
            assert v["kind"] in ("near", "far") and 0 <= v["auroc"] <= 1 and 0 <= v["fpr95"] <= 1
    de = next(r for r in rows if r["method"] == "deep_ensemble")
    single = [r for r in rows if r["method"] == "single"]
    assert de["members"] == 3 and de["params"] == sum(r["params"] for r in single)
    assert all(r["mi_id"] == 0 for r in single)  # one member: no mutual information


@pytest.mark.slow
def test_fast_mode_smoke_end_to_end(tmp_path: Path):
    """Tiny sizes of the image setting through quality, ablations and cost, then the summary's shape."""
    ctx = _smoke_context(tmp_path)
    rows = q.run_setting(ctx, hydra_seeds=(0, 1, 2))
    _check_quality_rows(rows)
    # rerunning hits the cache (bases, rankings, member checkpoints) and gives the same numbers
    again = q.run_setting(ctx, hydra_seeds=(0,), methods=("single", "hydra_circ"))
    first = {(r["method"], r["seed"]): r for r in rows}
    for r in again:
        assert r["acc"] == first[(r["method"], r["seed"])]["acc"]
        assert r["nll"] == pytest.approx(first[(r["method"], r["seed"])]["nll"], abs=1e-6)
    abl = q.run_ablations(ctx)
    assert [(r["ablation"], r["value"]) for r in abl] == [
        ("members", 1),
        ("members", 2),
        ("heads_kept", "5/6"),
        ("diversity", "none"),
        ("diversity", "order"),
        ("diversity", "pruning"),
        ("diversity", "both"),
    ]
    none = next(r for r in abl if r["value"] == "none")
    assert none["mi_id"] == pytest.approx(0, abs=1e-6) and none["disagreement_id"] == 0  # identical members
    crows = cost_mod.run_layout(
        "image", cost_mod.Grid(batches=(1,), precisions=("fp32",), repeats=1), progress=lambda s: None
    )
    assert {r["method"] for r in crows} == set(cost_mod.METHODS)
    assert all(COST_KEYS <= set(r) and r["latency_ms_min"] > 0 for r in crows)
    by = {r["method"]: r for r in crows}
    assert by["deep_ensemble"]["macs"] == 3 * by["single"]["macs"]
    assert by["hydra_unfused"]["macs"] < by["deep_ensemble"]["macs"]
    out = tmp_path / "results"
    out.mkdir()
    run_mod.write_part(out, "quality", rows, "setting", {"image"}, {"mode": "custom"})
    run_mod.write_part(out, "ablations", abl, "setting", {"image"}, {"mode": "custom"})
    run_mod.write_part(out, "cost", crows, "layout", {"image"}, {"mode": "custom"})
    summary = run_mod.write_outputs(out, tmp_path / "README.md", "test")
    assert {"machine", "quality", "cost"} <= set(summary)
    assert {p.name for p in (out / "plots").iterdir()} == {"quality.png", "cost.png", "ablations.png"}
    assert np.isfinite([r["latency_ms_median"] for r in summary["cost"]]).all()


def test_cost_rows_of_a_small_layout_are_timed_side_by_side():
    """run_layout on the image setting's architecture (random weights): every method, positive latencies, exact MACs."""
    rows = cost_mod.run_layout(
        "image", cost_mod.Grid(batches=(1, 2), precisions=("fp32",), repeats=2), progress=lambda s: None
    )
    assert {(r["method"], r["batch"]) for r in rows} == {(m, b) for m in cost_mod.METHODS for b in (1, 2)}
    assert all(COST_KEYS <= set(r) for r in rows)
    assert all(0 < r["latency_ms_min"] <= r["latency_ms_median"] for r in rows)
    by = {r["method"]: r for r in rows if r["batch"] == 1}
    assert by["deep_ensemble"]["macs"] == 3 * by["single"]["macs"]
    assert by["member"]["macs"] < by["single"]["macs"] < by["hydra"]["macs"] < by["deep_ensemble"]["macs"]
    ratios = {r["method"]: r for r in cost_mod.ratios(rows, "single") if r["batch"] == 1}
    assert ratios["single"]["ratio_min"] == 1.0 and ratios["deep_ensemble"]["macs_ratio"] == 3.0


def test_ratios_stay_within_a_backend():
    rows = [
        {
            "layout": "x",
            "device": "cpu",
            "backend": be,
            "precision": "fp32",
            "batch": 1,
            "method": m,
            "latency_ms_min": t,
            "latency_ms_median": t,
            "params": 1,
            "macs": 1,
        }
        for be, m, t in (
            ("eager", "single", 10.0),
            ("eager", "hydra", 12.0),
            ("onnx", "single", 4.0),
            ("onnx", "hydra", 6.0),
        )
    ]
    by = {(r["backend"], r["method"]): r["ratio_min"] for r in cost_mod.ratios(rows, "single")}
    assert by["eager", "hydra"] == pytest.approx(1.2) and by["onnx", "hydra"] == pytest.approx(1.5)


@pytest.mark.parametrize("backend", ["onnx", pytest.param("aoti", marks=pytest.mark.slow)])
def test_compiled_backends_compute_what_eager_computes(tmp_path: Path, backend: str):
    """The cost benchmark's compiled methods are the eager models exported (the server's loaders): same logits,
    and the Deep Ensemble runs M separate instances."""
    models = cost_mod.build("image", members=3)
    eager = bench_fusion.methods(models)
    compiled = cost_mod.compiled_methods(models, backend, tmp_path, progress=lambda s: None)
    x = models["make_input"](3)
    with torch.inference_mode():
        torch.testing.assert_close(compiled["single"](x), eager["single"](x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(compiled["hydra"](x), eager["hydra"](x), atol=1e-4, rtol=1e-4)
        de = compiled["deep_ensemble"](x)
    assert len(de) == 3 and all(torch.equal(d, de[0]) for d in de)  # one export, three loaded copies


def test_peak_probe_reports_a_positive_throughput():
    assert 0 < cost_mod.peak_gflops("fp32", n=256, repeats=2) < 1e6


def test_a_results_artifact_is_named_from_the_repository_root(tmp_path):
    import argparse

    from benchmarks import harness

    args = argparse.Namespace(tiny=None)
    inside = harness.result_head("bench_server", ["--x"], "m", args, harness.ROOT / "artifacts" / "default" / "text")
    assert (
        inside["artifact"] == "artifacts/default/text" and inside["command"] == "python -m benchmarks.bench_server --x"
    )
    assert harness.result_head("bench_server", [], "m", args, tmp_path)["artifact"] == str(tmp_path)
    assert harness.result_head("b", [], "m", argparse.Namespace(tiny="vit"), tmp_path)["artifact"] == (
        "tiny vit (random weights)"
    )
