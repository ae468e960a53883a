"""Hydra members: M pruned copies of one base model, differing by their pruning seed.

Given a ranking of heads (least important first), member m removes a head set
drawn with its own seed from the least important candidates: the paper samples
48 heads to prune out of the 100 least important ones, three times. Budgets are
either a global head count or a number of heads per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PAPER_POOL_RATIO = 100 / 48  # candidates per pruned head in the paper's sampling
PAPER_POOL_SHARE = 100 / 144  # candidates per head of the model (ViT-B/16 has 144 heads)


@dataclass(frozen=True)
class Budget:
    """How many heads each member prunes: ``per_layer`` heads in every layer, or ``total`` heads overall."""

    per_layer: int | None = None
    total: int | None = None

    def __post_init__(self) -> None:
        if (self.per_layer is None) == (self.total is None):
            raise ValueError("give exactly one of per_layer and total in the pruning budget")
        n = self.per_layer if self.per_layer is not None else self.total
        if n < 0:
            raise ValueError(f"pruning budget must be >= 0, got {n}")

    def check(self, heads_per_layer: Sequence[int]) -> None:
        """Refuse budgets that prune more heads than exist (one clear line)."""
        if self.per_layer is not None:
            bad = [i for i, h in enumerate(heads_per_layer) if self.per_layer > h]
            if bad:
                raise ValueError(
                    f"cannot prune {self.per_layer} heads per layer: layer {bad[0]} has {heads_per_layer[bad[0]]}"
                )
        elif self.total > sum(heads_per_layer):
            raise ValueError(f"cannot prune {self.total} heads: the model has {sum(heads_per_layer)}")

    def per_layer_counts(self, heads_per_layer: Sequence[int]) -> list[int]:
        """Heads pruned per layer (a global total is spread evenly, earlier layers taking the remainder)."""
        self.check(heads_per_layer)
        if self.per_layer is not None:
            return [self.per_layer] * len(heads_per_layer)
        L = len(heads_per_layer)
        base, extra = divmod(self.total, L)
        return [min(h, base + (1 if i < extra else 0)) for i, h in enumerate(heads_per_layer)]


def pool_size(n_prune: int, available: int, pool: int | float | None) -> int:
    """Candidate pool for sampling ``n_prune`` of ``available`` heads: an explicit count, a ratio, or the paper's.

    The paper draws 48 heads from the 100 least important of ViT-B/16's 144: the
    default pool is ``n_prune * 100/48`` capped at ``available * 100/144``. Both give
    100 there (and 4 of 6 heads for pruning 2 per layer); the cap matters when half a
    layer is pruned (BERT's 6 of 12 heads per layer): without it the pool would be the
    whole layer, members would prune uniformly random heads and the ranking would be
    ignored; with it the pool is the 8 least important and the top 4 always stay. The
    cap never takes away the last choice (pool >= n_prune + 1 where heads remain).
    """
    if pool is None:
        size = min(round(n_prune * PAPER_POOL_RATIO), round(available * PAPER_POOL_SHARE))
        size = max(size, min(n_prune + 1, available)) if n_prune else 0
    elif isinstance(pool, float):  # a ratio of candidates to pruned heads
        size = round(n_prune * pool)
    else:  # an explicit number of candidates
        size = int(pool)
    return max(n_prune, min(size, available))


def sample_members(
    ranking: Sequence[tuple[int, int]],
    heads_per_layer: Sequence[int],
    budget: Budget,
    seeds: Sequence[int],
    pool: int | float | None = None,
    shared: int = 0,
) -> list[list[list[int]]]:
    """Kept heads (per member, per layer, base indices) for each seed.

    ``ranking`` lists (layer, head), least important first; it may be partial but
    must cover the candidate pool. Global budget: candidates are the first
    ``pool`` heads of the ranking, ``budget.total`` of them are drawn per member.
    Per-layer budget: in each layer the candidates are that layer's first ``pool``
    heads in ranking order and ``budget.per_layer`` are drawn. The same seed gives
    the same member. A layer is never emptied by a per-layer budget smaller than its head count.
    ``shared``: the layers before it (a shared trunk) keep every head; only the later ones are candidates.
    """
    L = len(heads_per_layer)
    budget.check(heads_per_layer[shared:])
    ranking = [(lay, h) for lay, h in ranking if lay >= shared]
    members = []
    if budget.total is not None:
        n = budget.total
        size = pool_size(n, sum(heads_per_layer[shared:]), pool)
        if len(ranking) < size:
            raise ValueError(f"the ranking covers {len(ranking)} heads, the pool needs {size}")
        candidates = list(ranking[:size])
        for seed in seeds:
            rng = np.random.default_rng(seed)
            drop = {candidates[i] for i in rng.choice(size, size=n, replace=False)}
            members.append([[h for h in range(heads_per_layer[lay]) if (lay, h) not in drop] for lay in range(L)])
    else:
        r = budget.per_layer
        per_layer = [[h for lay, h in ranking if lay == layer] for layer in range(L)]
        for seed in seeds:
            rng = np.random.default_rng(seed)
            keep: list[list[int]] = [list(range(heads_per_layer[layer])) for layer in range(shared)]
            for layer in range(shared, L):
                order = per_layer[layer]
                size = pool_size(r, heads_per_layer[layer], pool)
                if len(order) < size:
                    raise ValueError(f"layer {layer}: the ranking covers {len(order)} heads, the pool needs {size}")
                drop = set(rng.choice(order[:size], size=r, replace=False).tolist()) if r else set()
                keep.append([h for h in range(heads_per_layer[layer]) if h not in drop])
            members.append(keep)
    if len(seeds) > 1 and len({repr(m) for m in members}) == 1:
        raise ValueError("all members prune the same heads: enlarge the candidate pool or change the seeds")
    return members
