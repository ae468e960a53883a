"""The member recipe's levers reach the members' training runs: distillation from the unpruned base (weight,
temperature per member) and partial fine-tuning of the last blocks."""

from __future__ import annotations

from offline.build import build
from offline.stages.finetune import member_train_config

from .conftest import ticket_config


def test_member_train_config_carries_the_levers(user_files):
    ckpt, data = user_files
    cfg = ticket_config(
        ckpt, data, **{"hydra.distill": 0.7, "hydra.distill_temperatures": [1.0, 2.0, 4.0], "hydra.finetune_blocks": 1}
    )
    runs = [member_train_config(cfg, i) for i in range(3)]
    assert [r.distill_weight for r in runs] == [0.7] * 3
    assert [r.distill_temperature for r in runs] == [1.0, 2.0, 4.0]
    assert {r.last_blocks for r in runs} == {1}
    plain = member_train_config(ticket_config(ckpt, data), 0)
    assert (plain.distill_weight, plain.distill_temperature, plain.last_blocks) == (0.0, 1.0, 0)


def test_a_build_distils_each_member_from_the_base_at_its_temperature(user_files, tmp_path, monkeypatch):
    """Each member's run gets the unpruned base as its teacher (more heads than the member), its own temperature,
    and trains only the last block."""
    from offline.train import runs

    seen = []
    real_fit = runs.fit

    def spy(model, forward, get_batch, n, tcfg, desc="train", resume=None, teacher=None):
        seen.append((model, tcfg, teacher))
        return real_fit(model, forward, get_batch, n, tcfg, desc, resume, teacher)

    monkeypatch.setattr(runs, "fit", spy)
    ckpt, data = user_files
    over = {"hydra.distill": 0.5, "hydra.distill_temperatures": [1.0, 3.0, 5.0], "hydra.finetune_blocks": 1}
    build(ticket_config(ckpt, data, **over), tmp_path / "artifact")
    members = seen[-3:]
    assert [t.distill_temperature for _, t, _ in members] == [1.0, 3.0, 5.0]
    assert {(t.distill_weight, t.last_blocks) for _, t, _ in members} == {(0.5, 1)}
    for model, _, teacher in members:
        assert teacher is not None and teacher is not model
        assert sum(p.numel() for p in teacher.parameters()) > sum(p.numel() for p in model.parameters())
