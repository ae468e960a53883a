"""The efficient-ensemble baselines (``base.baselines``): each layer does what its library says, and a build reports
each one as a row scored like Hydra's (accuracy, NLL, ECE at T = 1 and at its own temperature, AURC, every OOD
score with the same statistics' treatment, parameters, latency)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from offline.build import build
from offline.config import ConfigError
from offline.pipelines.baselines import BatchEnsembleLinear, batch_ensembled

from .conftest import ticket_config, tiny_vit


def test_batch_ensemble_linear_gives_member_i_its_own_rank_1_factors():
    torch.manual_seed(0)
    linear = nn.Linear(6, 5)
    be = BatchEnsembleLinear(linear, members=3, generator=torch.Generator().manual_seed(1))
    r, s, bias = be.layer.r_group, be.layer.s_group, be.layer.bias
    assert not torch.equal(r[0], r[1])  # the members start apart ...
    torch.testing.assert_close(bias, linear.bias.expand(3, 5))  # ... from the linear's weights and bias
    x = torch.randn(3 * 2, 4, 6)  # 3 members x 2 sequences of 4 tokens
    y = be(x)
    for i in range(3):  # member i: rows [2 i, 2 i + 2): ((x * r_i) W^T) * s_i + b_i, the BatchEnsemble layer
        want = (x[2 * i : 2 * i + 2] * r[i]) @ linear.weight.t() * s[i] + bias[i]
        torch.testing.assert_close(y[2 * i : 2 * i + 2], want)
    # torch-uncertainty's own forward over the rows (its estimator i: the i-th block of rows) gives the same
    torch.testing.assert_close(y.reshape(-1, 5), be.layer(x.reshape(-1, 6)))
    with torch.no_grad():  # factors of 1: the pretrained linear itself
        r.fill_(1)
        s.fill_(1)
    torch.testing.assert_close(be(x), linear(x))


def test_batch_ensembled_vit_starts_at_the_base():
    base = tiny_vit()
    model = batch_ensembled(base, 3, seed=0)
    linears = sum(isinstance(m, nn.Linear) for m in base.modules())
    assert sum(isinstance(m, BatchEnsembleLinear) for m in model.modules()) == linears  # every linear layer
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BatchEnsembleLinear):
                m.layer.r_group.fill_(1)
                m.layer.s_group.fill_(1)
        x = torch.randn(2, 1, 16, 16)
        torch.testing.assert_close(model(x.repeat(3, 1, 1, 1)), base(x).repeat(3, 1), atol=1e-5, rtol=0)


def test_unknown_baseline_is_one_line(user_files):
    ckpt, data = user_files
    with pytest.raises(ConfigError, match=r"base\.baselines: unknown baseline 'packed'"):
        ticket_config(ckpt, data, **{"base.baselines": ["packed"]})


def test_a_build_reports_every_baseline_like_hydra(user_files, tmp_path):
    ckpt, data = user_files
    far = tmp_path / "weather.txt"  # an OOD set, so that every OOD score is scored
    far.write_text("".join(f"rain and wind over the hills on day {i}\n" for i in range(40)))
    over = {"base.baselines": ["lora_ensemble", "batch_ensemble", "laplace"], "data.ood_paths": {"weather": str(far)}}
    cfg = ticket_config(ckpt, data, **over)
    out = build(cfg, tmp_path / "artifact")
    rows = {r["method"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    served = json.loads((out / "manifest.json").read_text())["uncertainty"]["ood_score"]
    for name in ("lora_ensemble", "batch_ensemble", "laplace"):
        row = rows[name]
        for key in ("acc", "nll", "ece", "aurc", "params", "latency_ms"):
            assert row[key] is not None, (name, key)
        assert 0 <= row["calibrated"]["ece"] <= 1 and row["calibrated"]["temperature"] > 0
        assert served in row["ood_scores"] and "msp" in row["ood_scores"]
        assert 0 < row["acc"] <= 1
    # LoRA trains adapters only: a few parameters over the base's; BatchEnsemble adds factors to every linear
    single = rows["single"]["params"]
    assert single < rows["lora_ensemble"]["params"] < 1.2 * single
    assert single < rows["batch_ensemble"]["params"] < 1.2 * single
    # last-layer Laplace keeps Single's features: its feature score is Single's to the digit; its probabilities and
    # so its MSP are its own
    auroc = {m: {s: rows[m]["ood_scores"][s]["avg"]["auroc"] for s in ("mahalanobis", "msp")} for m in rows}
    assert auroc["laplace"]["mahalanobis"] == auroc["single"]["mahalanobis"]
    assert auroc["laplace"]["msp"] != auroc["single"]["msp"]
    assert rows["laplace"]["nll"] != rows["single"]["nll"]
    # the ensembles' members differ: their mutual information on OOD inputs is not zero
    assert rows["lora_ensemble"]["mi_ood"] > 0 and rows["batch_ensemble"]["mi_ood"] > 0


def test_a_baseline_whose_library_is_missing_fails_before_training(user_files, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    ckpt, data = user_files
    with pytest.raises(ConfigError, match=r"base\.baselines lora_ensemble needs the peft package: pip install"):
        ticket_config(ckpt, data, **{"base.baselines": ["lora_ensemble"]})
