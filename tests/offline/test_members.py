from __future__ import annotations

import pytest

from offline.method.members import Budget, pool_size, sample_members


def test_global_budget_draws_from_the_least_important_pool():
    heads = [12] * 12
    ranking = [(i % 12, i // 12) for i in range(144)]  # any fixed order
    members = sample_members(ranking, heads, Budget(total=48), seeds=[0, 1, 2], pool=100)
    pool = set(ranking[:100])
    for keep in members:
        dropped = {(lay, h) for lay in range(12) for h in range(12) if h not in keep[lay]}
        assert len(dropped) == 48 and dropped <= pool
    assert len({repr(m) for m in members}) == 3
    assert members == sample_members(ranking, heads, Budget(total=48), seeds=[0, 1, 2], pool=100)


def test_per_layer_budget_keeps_the_count_in_every_layer():
    heads = [12] * 6
    ranking = [(lay, h) for h in range(12) for lay in range(6)]
    members = sample_members(ranking, heads, Budget(per_layer=6), seeds=[0, 1, 2], pool=9)
    for keep in members:
        assert all(len(k) == 6 for k in keep)
        # only heads among each layer's 9 least important are dropped: heads 9, 10, 11 always kept
        assert all({9, 10, 11} <= set(k) for k in keep)


def test_default_pool_keeps_each_layers_most_important_heads_with_half_pruned():
    heads = [12] * 6
    ranking = [(lay, h) for h in range(12) for lay in range(6)]  # head 11 of every layer is the most important
    members = sample_members(ranking, heads, Budget(per_layer=6), seeds=[0, 1, 2])
    for keep in members:
        assert all(len(k) == 6 and {8, 9, 10, 11} <= set(k) for k in keep)
    assert len({repr(m) for m in members}) == 3


def test_global_pool_counts_every_head_not_the_ranking_length():
    heads = [12] * 12
    ranking = [(i % 12, i // 12) for i in range(100)]  # a partial ranking covering the pool
    members = sample_members(ranking, heads, Budget(total=48), seeds=[0, 1])
    for keep in members:
        dropped = {(lay, h) for lay in range(12) for h in range(12) if h not in keep[lay]}
        assert len(dropped) == 48 and dropped <= set(ranking)
    with pytest.raises(ValueError, match="the pool needs 100"):
        sample_members(ranking[:99], heads, Budget(total=48), seeds=[0, 1])


def test_budget_errors_are_clear():
    with pytest.raises(ValueError, match="cannot prune 13 heads per layer"):
        Budget(per_layer=13).check([12, 12])
    with pytest.raises(ValueError, match="cannot prune 30 heads"):
        Budget(total=30).check([12, 12])
    with pytest.raises(ValueError, match="exactly one"):
        Budget()
    with pytest.raises(ValueError, match="same heads"):
        sample_members([(0, 0), (0, 1)], [2], Budget(total=1), seeds=[0, 1], pool=1)


def test_pool_size_paper_default_and_ratio():
    assert pool_size(48, 144, None) == 100
    assert pool_size(2, 6, None) == 4  # the image setting: 2 of 6 heads per layer
    assert pool_size(4, 12, None) == 8  # ViT-B/16 per layer (8 of 12 kept)
    # half a layer: capped at 100/144 of the heads, so the ranking decides (the top 4 of 12 always stay)
    assert pool_size(6, 12, None) == 8
    assert pool_size(1, 2, None) == 2  # the cap never removes the last choice
    assert pool_size(0, 12, None) == 0
    assert pool_size(4, 12, 2.0) == 8
    assert pool_size(4, 6, 10) == 6  # clipped to what exists
    assert pool_size(4, 12, 2) == 4  # never below the budget
