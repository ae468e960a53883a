"""Taylor scores match the paper's formula; greedy circuit extraction picks the right head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from offline.families import get_adapter
from offline.method.head_scores import (
    accumulate_grads,
    circuit_objective,
    circuit_ranking,
    random_ranking,
    taylor_layer_scores,
    taylor_prune,
)

from .conftest import bert_batch, tiny_bert, tiny_vit


def _vit_data(n=32, classes=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(n, 1, 16, 16, generator=g)}, torch.randint(0, classes, (n,), generator=g)


def test_taylor_scores_equal_paper_formula_vit():
    model = tiny_vit()
    adapter = get_adapter("vit")
    batch, y = _vit_data()
    accumulate_grads(adapter, model, [(batch, y)])
    # direct: autograd of the CE loss w.r.t. the fused qkv weight, then the formula head by head
    model.zero_grad()
    F.cross_entropy(model(batch["pixel_values"]), y).backward()
    for layer, blk in enumerate(model.blocks):
        W, G = blk.attn.qkv.weight.detach(), blk.attn.qkv.weight.grad
        D, H, hd = W.shape[1], 4, 8
        expected = []
        for h in range(H):
            s = 0.0
            for part in range(3):  # q, k, v blocks of rows
                rows = range(part * D + h * hd, part * D + (h + 1) * hd)
                s += sum(abs(W[r, c] * G[r, c]).item() for r in rows for c in range(D)) / (hd * D)
            expected.append(s / 3)
        got = taylor_layer_scores(adapter, model, layer)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-12)


def test_taylor_scores_bert_use_separate_qkv():
    model = tiny_bert()
    adapter = get_adapter("bert")
    batch, y = bert_batch(), torch.tensor([0, 1, 2, 0])
    accumulate_grads(adapter, model, [(batch, y)])
    s = model.bert.encoder.layer[1].attention.self
    hd, D = 8, 32
    expected = []
    for h in range(4):
        rows = slice(h * hd, (h + 1) * hd)
        parts = [(lin.weight[rows] * lin.weight.grad[rows]).abs().sum() / (hd * D) for lin in (s.query, s.key, s.value)]
        expected.append(float(sum(parts).detach() / 3))
    np.testing.assert_allclose(taylor_layer_scores(adapter, model, 1).numpy(), expected, rtol=1e-5)


def test_taylor_prune_layer_by_layer_recomputes_and_is_seeded():
    model = tiny_vit()
    adapter = get_adapter("vit")
    data = [_vit_data(seed=s) for s in range(2)]
    plain = taylor_prune(adapter, model, data, [1, 2, 1])
    assert adapter.heads(plain.model) == [3, 2, 3]
    # the lowest-scored heads were dropped in each layer (scores recorded at that layer's turn)
    for scores, dropped in zip(plain.scores, plain.pruned, strict=True):
        assert sorted(np.argsort(scores, kind="stable")[: len(dropped)].tolist()) == dropped
    # layer 1 was scored after layer 0 was pruned: its scores differ from scoring the unpruned model
    accumulate_grads(adapter, model, data)
    assert not np.allclose(taylor_layer_scores(adapter, model, 1).numpy(), plain.scores[1])
    a = taylor_prune(adapter, model, data, [1, 2, 1], pool_per_layer=[3, 4, 3], seed=7)
    b = taylor_prune(adapter, model, data, [1, 2, 1], pool_per_layer=[3, 4, 3], seed=7)
    assert a.pruned == b.pruned
    runs = [taylor_prune(adapter, model, data, [1, 2, 1], pool_per_layer=[3, 4, 3], seed=s) for s in range(6)]
    seeds = {repr(r.pruned) for r in runs}
    assert len(seeds) > 1


def test_circuit_picks_head_whose_removal_helps_most():
    """Labels are the model's own answers with head (1, 2) ablated: removing it gives accuracy 1."""
    model = tiny_vit(num_classes=5)
    adapter = get_adapter("vit")
    batch, _ = _vit_data(n=64)
    with torch.no_grad():
        plain = model(batch["pixel_values"]).argmax(-1)
        with adapter.ablate(model, {1: [2]}):
            y = model(batch["pixel_values"]).argmax(-1)
    assert (plain != y).any(), "constructed case needs the head to matter"
    res = circuit_ranking(adapter, model, [batch], y, [], score="acc", budget=1, progress=False)
    assert res.ranking == [(1, 2)]
    assert res.scores[0] == 1.0


@pytest.mark.parametrize("score", ["acc", "ood", "avg"])
def test_circuit_greedy_matches_brute_force(score):
    """Each greedy step equals a direct evaluation of every candidate (no caches), two steps deep."""
    model = tiny_vit(depth=2, heads=4)
    adapter = get_adapter("vit")
    (bid, y), (bood, _) = _vit_data(n=40, seed=1), _vit_data(n=40, seed=2)
    bood = {"pixel_values": bood["pixel_values"] * 3}
    res = circuit_ranking(adapter, model, [bid], y, [bood], score=score, budget=2, progress=False)
    objective = circuit_objective(score)
    removed: dict[int, list[int]] = {}
    for step in range(2):
        best, best_s = None, -np.inf
        for layer in range(2):
            for h in range(4):
                if h in removed.get(layer, []):
                    continue
                abl = {k: list(v) for k, v in removed.items()}
                abl.setdefault(layer, []).append(h)
                with torch.no_grad(), adapter.ablate(model, abl):
                    s = objective(model(bid["pixel_values"]), y, model(bood["pixel_values"]))
                if s > best_s:
                    best, best_s = (layer, h), s
        assert res.ranking[step] == best
        assert res.scores[step] == pytest.approx(best_s, abs=1e-6)
        removed.setdefault(best[0], []).append(best[1])
    # the caller's model is untouched
    fresh = tiny_vit(depth=2, heads=4)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True))


def test_circuit_bert_with_padding_and_per_layer_cap():
    model = tiny_bert()
    adapter = get_adapter("bert")
    batch, y = bert_batch(batch=8), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    res = circuit_ranking(
        adapter, model, [batch], y, [bert_batch(batch=8, seed=3)], score="avg", max_per_layer=[2, 2, 2], progress=False
    )
    assert len(res.ranking) == 6
    assert all(sum(1 for lay, _ in res.ranking if lay == layer) == 2 for layer in range(3))


def test_random_ranking_is_a_seeded_permutation():
    r = random_ranking([3, 2], seed=0)
    assert sorted(r) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert r == random_ranking([3, 2], seed=0) and r != random_ranking([3, 2], seed=1)


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_accumulate_grads_only_one_layer_gives_the_same_gradients(family):
    """Taylor's per-layer backward (other parameters frozen) equals the full backward for that layer's W_q, W_k, W_v."""
    model = tiny_vit() if family == "vit" else tiny_bert()
    adapter = get_adapter(family)
    data = [_vit_data()] if family == "vit" else [(bert_batch(), torch.tensor([0, 1, 2, 0]))]
    accumulate_grads(adapter, model, data)
    full = [g.clone() for g in adapter.qkv_grads(model, 1)]
    flags = [p.requires_grad for p in model.parameters()]
    accumulate_grads(adapter, model, data, only=adapter.qkv_weights(model, 1))
    for a, b in zip(full, adapter.qkv_grads(model, 1), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all(("layer.1." in n or "blocks.1." in n) and ("qkv" in n or "self." in n) for n in with_grad)
    assert [p.requires_grad for p in model.parameters()] == flags  # restored


def test_circuit_batches_sort_texts_by_length_with_their_labels():
    """Circuit extraction's text batches pad only to their own longest text; labels stay with their texts."""
    from transformers import AutoTokenizer

    from offline.stages.datasets import circuit_batches
    from offline.train import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path())
    rng = np.random.default_rng(0)
    texts = [" ".join(["word"] * int(n)) for n in rng.integers(1, 40, size=70)]
    labels = np.arange(70) % 2
    prep = {"type": "text", "max_length": 32}
    batches = circuit_batches(texts, labels, prep, tok)
    assert [len(y) for _, y in batches] == [32, 32, 6]
    got = [
        (tok.decode(ids[m.bool()], skip_special_tokens=True), int(label))
        for b, y in batches
        for ids, m, label in zip(b["input_ids"], b["attention_mask"], y, strict=True)
    ]
    want = {(" ".join(t.split()[:30]), int(label)) for t, label in zip(texts, labels, strict=True)}  # 30 + [CLS], [SEP]
    assert set(got) == want
    widths = [b["input_ids"].shape[1] for b, _ in batches]
    assert widths == sorted(widths) and widths[0] < widths[-1] <= 32


def test_length_sorted_batches_order_maps_back_to_the_inputs():
    from transformers import AutoTokenizer

    from offline.stages.datasets import length_sorted_batches
    from offline.train import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path())
    texts = [" ".join([f"w{i}"] * (1 + (7 * i) % 13)) for i in range(20)]
    labels = np.arange(20)
    batches, order = length_sorted_batches(texts, labels, {"type": "text", "max_length": 16}, tok, 8)
    np.testing.assert_array_equal(torch.cat([y for _, y in batches]).numpy(), labels[order])
    assert sorted(order.tolist()) == list(range(20))
    first = tok.decode(batches[0][0]["input_ids"][0], skip_special_tokens=True).replace(" ", "")
    assert first == texts[order[0]].replace(" ", "")
