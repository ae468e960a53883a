"""Training checkpoints: complete pairs only, the newest one kept, restored only by a run of the same fingerprint."""

from __future__ import annotations

import torch
from torch import nn

from offline.train import checkpoints


def _run(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))


def _train_one_step(model: nn.Module, opt: torch.optim.Optimizer, sched) -> None:
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    sched.step()


def test_only_the_newest_complete_checkpoint_is_kept(tmp_path):
    model, opt, sched = _run(0)
    assert checkpoints.completed_steps(tmp_path / "none") == 0
    for step in (3, 6):
        _train_one_step(model, opt, sched)
        checkpoints.save(tmp_path, step, model, opt, sched, "key")
    assert checkpoints.steps(tmp_path) == [6] and checkpoints.completed_steps(tmp_path) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-0000006.safetensors", "state-0000006.pt"]
    (tmp_path / "state-0000009.pt").write_bytes(b"")  # a state file without its weights: no checkpoint
    assert checkpoints.steps(tmp_path) == [6]


def test_restore_gives_back_the_weights_optimizer_schedule_and_rng(tmp_path):
    model, opt, sched = _run(0)
    _train_one_step(model, opt, sched)
    checkpoints.save(tmp_path, 1, model, opt, sched, "key")
    draw = torch.rand(3)  # the global RNG after the checkpoint
    other, other_opt, other_sched = _run(1)
    assert checkpoints.restore(tmp_path, other, other_opt, other_sched, "another key") == 0  # not this run's
    assert not torch.equal(other.weight, model.weight)
    assert checkpoints.restore(tmp_path, other, other_opt, other_sched, "key") == 1
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert other_sched.last_epoch == sched.last_epoch
    mine, restored = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert all(torch.equal(restored[i][k], mine[i][k]) for i in mine for k in mine[i])  # AdamW's moments and step
    assert torch.equal(torch.rand(3), draw)
