"""Head importance: first-order Taylor (with layer-by-layer prune and recompute), greedy circuit extraction, random.

Formulas follow the paper's appendix "Details on Method Implementations":

* Taylor: for head h of layer l with rows R_h of W_q, W_k, W_v (each ``(D, D)``)
  and their loss gradients G, ``q_h = 1/(d_h D) Σ_{r∈R_h} Σ_c |W_rc G_rc|`` (same
  for k, v) and ``s_h = (q_h + k_h + v_h) / 3``. Layers are scored and pruned one
  after the other, gradients recomputed after every layer's pruning.
* Circuit (Algorithm 1): repeatedly ablate each remaining head temporarily
  (zero its output-projection columns), evaluate S ∈ {acc, MSP-AUROC, their
  average} on validation data, and remove for good the head whose removal gives
  the highest S. The removal order is the ranking, least useful head first.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from offline.families import FamilyAdapter
from service.core.progress import bar as progress_bar

Batch = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- Taylor
def accumulate_grads(
    adapter: FamilyAdapter,
    model: nn.Module,
    batches: Sequence[tuple[Batch, torch.Tensor]],
    only: Sequence[torch.Tensor] | None = None,
) -> None:
    """Zero the grads, then sum d(CE loss)/dθ over the calibration batches (each loss a batch mean).

    ``only``: the gradients wanted (parameters or views of them, e.g. one layer's
    W_q, W_k, W_v); every other parameter is frozen for the pass, so the backward
    stops at that layer and computes no other weight gradient (same values, about
    half the work of a full backward for Taylor's layer-by-layer scoring).
    """
    model.zero_grad(set_to_none=True)
    was_training = model.training
    saved = None
    if only is not None:
        wanted = {id(t._base if t._base is not None else t) for t in only}
        saved = [(p, p.requires_grad) for p in model.parameters()]
        for p, _ in saved:
            p.requires_grad_(id(p) in wanted)
    model.eval()  # no dropout: scores must be a deterministic function of the weights
    try:
        for batch, labels in batches:
            loss = F.cross_entropy(adapter.forward(model, batch), labels)
            loss.backward()
    finally:
        model.train(was_training)
        for p, flag in saved or ():
            p.requires_grad_(flag)


def taylor_layer_scores(adapter: FamilyAdapter, model: nn.Module, layer: int) -> torch.Tensor:
    """Per-head Taylor scores ``(H,)`` of ``layer`` from the gradients already accumulated on ``model``."""
    hd = adapter.head_dim(model)
    parts = []
    for w, g in zip(adapter.qkv_weights(model, layer), adapter.qkv_grads(model, layer), strict=True):
        prod = (w.detach() * g.detach()).abs()  # (H*hd, D)
        H, D = prod.shape[0] // hd, prod.shape[1]
        parts.append(prod.view(H, hd, D).sum(dim=(1, 2)) / (hd * D))  # (H,)
    return sum(parts) / 3


@dataclass
class TaylorResult:
    model: nn.Module  # the structurally pruned member
    pruned: list[list[int]]  # base-model head indices removed, per layer
    scores: list[list[float]] = field(default_factory=list)  # scores of the heads present when the layer was scored


def taylor_prune(
    adapter: FamilyAdapter,
    model: nn.Module,
    batches: Sequence[tuple[Batch, torch.Tensor]],
    prune_per_layer: Sequence[int],
    pool_per_layer: Sequence[int] | None = None,
    seed: int | None = None,
    progress: bool = False,
) -> TaylorResult:
    """Layer-by-layer Taylor pruning with gradient recomputation after every layer.

    In layer l the ``prune_per_layer[l]`` heads to remove are the least important
    ones (``seed=None``), or are drawn with ``seed`` from the ``pool_per_layer[l]``
    least important ones (how Hydra members differ).
    """
    L = adapter.num_layers(model)
    if len(prune_per_layer) != L:
        raise ValueError(f"prune_per_layer has {len(prune_per_layer)} entries for {L} layers")
    rng = np.random.default_rng(seed) if seed is not None else None
    pruned_all: list[list[int]] = []
    scores_all: list[list[float]] = []
    current = model
    for layer in progress_bar(range(L), desc="taylor scoring (layers)", wanted=progress):
        r = int(prune_per_layer[layer])
        H = adapter.heads(current)[layer]
        if r < 0 or r > H:
            raise ValueError(f"layer {layer}: cannot prune {r} of {H} heads")
        if r == 0:
            pruned_all.append([])
            scores_all.append([])
            continue
        accumulate_grads(adapter, current, batches, only=adapter.qkv_weights(current, layer))
        s = taylor_layer_scores(adapter, current, layer)
        order = torch.argsort(s, stable=True).tolist()  # least important first
        pool = r if rng is None or pool_per_layer is None else max(r, min(int(pool_per_layer[layer]), H))
        drop = order[:r] if rng is None else sorted(rng.choice(order[:pool], size=r, replace=False).tolist())
        keep = [[*range(h)] for h in adapter.heads(current)]
        keep[layer] = [h for h in range(H) if h not in drop]
        base = adapter.kept_heads(current)[layer]
        pruned_all.append(sorted(base[h] for h in drop))
        scores_all.append(s.tolist())
        current.zero_grad(set_to_none=True)
        current = adapter.prune(current, keep)
    current.zero_grad(set_to_none=True)
    return TaylorResult(current, pruned_all, scores_all)


# ----------------------------------------------------------------------------- circuits
def msp_auroc(msp_id: torch.Tensor, msp_ood: torch.Tensor) -> float:
    """AUROC of separating OOD (positive) from ID with score −MSP; ties count one half."""
    from sklearn.metrics import roc_auc_score

    y = np.r_[np.zeros(len(msp_id)), np.ones(len(msp_ood))]
    return float(roc_auc_score(y, -np.r_[msp_id.float().cpu().numpy(), msp_ood.float().cpu().numpy()]))


def circuit_objective(kind: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], float]:
    """S(logits_id, labels, logits_ood) for ``kind`` in acc | ood | avg."""

    def acc(li: torch.Tensor, y: torch.Tensor, lo: torch.Tensor) -> float:
        return float((li.argmax(-1) == y).float().mean())

    def ood(li: torch.Tensor, y: torch.Tensor, lo: torch.Tensor) -> float:
        return msp_auroc(li.softmax(-1).amax(-1), lo.softmax(-1).amax(-1))

    if kind == "acc":
        return acc
    if kind == "ood":
        return ood
    if kind == "avg":
        return lambda li, y, lo: 0.5 * (acc(li, y, lo) + ood(li, y, lo))
    raise ValueError(f"unknown circuit score {kind!r}; expected acc, ood or avg")


@dataclass
class CircuitResult:
    ranking: list[tuple[int, int]]  # (layer, head) in removal order: least useful first
    scores: list[float]  # S after each removal
    base_score: float  # S of the unablated model


class HiddenStateCache:
    """Hidden states at every layer input of a fixed set of batches, for the current permanent ablations."""

    def __init__(self, adapter: FamilyAdapter, model: nn.Module, batches: Sequence[Batch]) -> None:
        self.adapter, self.model = adapter, model
        self.ctx, self.h = [], []  # h[b][l]: input of layer l for batch b (l = L is the encoder output)
        for batch in batches:
            h, ctx = adapter.stem(model, batch)
            self.ctx.append(ctx)
            self.h.append([h])
        self.refresh(0)

    def refresh(self, start: int) -> None:
        L = self.adapter.num_layers(self.model)
        for hs, ctx in zip(self.h, self.ctx, strict=True):
            del hs[start + 1 :]
            for layer in range(start, L):
                hs.append(self.adapter.block(self.model, layer, hs[layer], ctx))

    def logits_from(self, start: int) -> torch.Tensor:
        """Logits of all batches, recomputing layers ``start..L-1`` (the ones an ablation in ``start`` changes)."""
        L = self.adapter.num_layers(self.model)
        out = []
        for hs, ctx in zip(self.h, self.ctx, strict=True):
            h = hs[start]
            for layer in range(start, L):
                h = self.adapter.block(self.model, layer, h, ctx)
            out.append(self.adapter.readout(self.model, h, ctx))
        return torch.cat(out)


class _Ablations:
    """A model under circuit extraction: its permanent ablations so far, the hidden states cached for them, and the
    objective S on the validation batches (ID, and OOD unless S is accuracy alone)."""

    def __init__(
        self,
        adapter: FamilyAdapter,
        model: nn.Module,
        id_batches: Sequence[Batch],
        id_labels: torch.Tensor,
        ood_batches: Sequence[Batch] | None,
        objective: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], float],
    ) -> None:
        self.adapter, self.model, self.id_labels, self.objective = adapter, model, id_labels, objective
        self.id_cache = HiddenStateCache(adapter, model, id_batches)
        self.ood_cache = HiddenStateCache(adapter, model, ood_batches) if ood_batches is not None else None

    def evaluate(self, start: int) -> float:
        """S of the model as it is, recomputing layers ``start..L-1`` (the ones an ablation in ``start`` changes)."""
        lo = self.ood_cache.logits_from(start) if self.ood_cache is not None else torch.empty(0)
        return self.objective(self.id_cache.logits_from(start), self.id_labels, lo)

    def best(self, candidates: list[tuple[int, int]], full: set[int], bar: Any) -> tuple[tuple[int, int] | None, float]:
        """The candidate ``(layer, head)`` whose temporary ablation gives the highest S, and that S (the heads of the
        ``full`` layers are not candidates this round); the first of equals wins."""
        best, best_s = None, -np.inf
        for layer, h in candidates:
            if layer not in full:
                with self.adapter.ablate(self.model, {layer: [h]}):
                    s = self.evaluate(layer)
                if s > best_s:
                    best, best_s = (layer, h), s
            bar.update(1)
        return best, best_s

    def remove(self, layer: int, h: int) -> None:
        """AblatePerm: zero the head's output columns for good, then refresh the caches from that layer on."""
        w = self.adapter.out_proj(self.model, layer).weight
        hd = self.adapter.head_dim(self.model)
        w[:, h * hd : (h + 1) * hd] = 0
        self.id_cache.refresh(layer)
        if self.ood_cache is not None:
            self.ood_cache.refresh(layer)


@torch.no_grad()
def circuit_ranking(
    adapter: FamilyAdapter,
    model: nn.Module,
    id_batches: Sequence[Batch],
    id_labels: torch.Tensor,
    ood_batches: Sequence[Batch],
    score: str = "avg",
    budget: int | None = None,
    max_per_layer: Sequence[int] | None = None,
    progress: bool = True,
) -> CircuitResult:
    """Greedy circuit extraction (Algorithm 1), returning the removal order of ``budget`` heads.

    Cost: Σ_t |R_t| evaluations; each one reruns only the layers from the ablated
    one onwards, starting from cached hidden states (the layers before it do not
    change), on the whole validation set in large batches. ``max_per_layer`` caps
    how many heads of each layer may be ranked (used with per-layer budgets).
    """
    objective = circuit_objective(score)
    model = copy.deepcopy(model)  # permanent ablations below must not touch the caller's model
    heads = adapter.heads(model)
    L = len(heads)
    candidates = [(layer, h) for layer in range(L) for h in range(heads[layer])]
    budget = len(candidates) if budget is None else int(budget)
    if budget > len(candidates):
        raise ValueError(f"circuit budget {budget} exceeds the {len(candidates)} heads of the model")
    model.eval()
    run = _Ablations(adapter, model, id_batches, id_labels, ood_batches if score != "acc" else None, objective)
    base_score = run.evaluate(L)
    removed: dict[int, list[int]] = {}
    ranking: list[tuple[int, int]] = []
    scores: list[float] = []
    total = sum(len(candidates) - t for t in range(budget))
    bar = progress_bar(desc=f"circuit extraction ({score}, evaluations)", total=total, wanted=progress)
    for _ in range(budget):
        full = set() if max_per_layer is None else {i for i in range(L) if len(removed.get(i, [])) >= max_per_layer[i]}
        best, best_s = run.best(candidates, full, bar)
        if best is None:
            break
        layer, h = best
        removed.setdefault(layer, []).append(h)
        candidates.remove(best)
        ranking.append(best)
        scores.append(float(best_s))
        run.remove(layer, h)
    bar.close()
    return CircuitResult(ranking, scores, float(base_score))


def random_ranking(heads_per_layer: Sequence[int], seed: int) -> list[tuple[int, int]]:
    """All heads in a random order (the ``random`` strategy)."""
    heads = [(layer, h) for layer, n in enumerate(heads_per_layer) for h in range(n)]
    order = np.random.default_rng(seed).permutation(len(heads))
    return [heads[i] for i in order]
