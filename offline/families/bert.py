"""Adapter for Hugging Face BERT-family encoders with a classification head (``BertForSequenceClassification``).

``transformers`` 5.x has no ``prune_heads``: heads are sliced out of the
query/key/value and output-dense weights here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from offline.families.base import FamilyAdapter, fuse_blocks, grouped_linear, layer_weights, member_norm, shared_or_mean
from service.core.families import BERT

# Hugging Face ``hidden_act`` -> the fused model's activation name
BERT_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


class ZeroSelfAttention(nn.Module):
    """Replaces ``BertSelfAttention`` when every head of a layer is pruned: empty output ``(B, T, 0)``."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return hidden_states.new_zeros(*hidden_states.shape[:-1], 0), None


def check_supported(model: nn.Module) -> None:
    """Raise TypeError / ValueError naming the BERT feature the fused model does not implement."""
    from transformers import BertForSequenceClassification

    if not isinstance(model, BertForSequenceClassification):
        raise TypeError(f"the bert family expects a BertForSequenceClassification, got {type(model).__name__}")
    cfg = model.config
    if cfg.hidden_act not in BERT_ACTS:
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: {sorted(BERT_ACTS)}")
    if cfg.is_decoder:
        raise ValueError("decoder BERT models are not supported")


def bert_layer_weights(lay: nn.Module) -> dict[str, Any]:
    """Canonical weights (:func:`.base.layer_weights`) of a Hugging Face ``BertLayer``, all its heads pruned or not."""
    s, o = lay.attention.self, lay.attention.output
    if isinstance(s, ZeroSelfAttention):
        empty = torch.zeros(0, o.dense.out_features)
        qkv, qkv_b = (empty, empty, empty), (torch.zeros(0),) * 3
    else:
        qkv, qkv_b = (s.query.weight, s.key.weight, s.value.weight), (s.query.bias, s.key.bias, s.value.bias)
    out = lay.output
    return layer_weights(qkv, qkv_b, o.dense, o.LayerNorm, out.LayerNorm, lay.intermediate.dense, out.dense)


def fuse_bert_encoder(
    berts: Sequence[nn.Module], prefix: str, mlp: str, report: dict[str, float], sd: dict[str, torch.Tensor]
) -> list[int]:
    """Fuse M Hugging Face ``BertModel`` encoders into ``sd``; returns the padded head count of every layer.

    Keys: ``{prefix}word_embeddings.weight`` (and the position and token-type ones; shared, or averaged),
    ``{prefix}emb_norm.*`` (per member) and the blocks ``{prefix}encoder.blocks.{i}.*``.
    """
    embs = [b.embeddings for b in berts]
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        sd[f"{prefix}{name}.weight"] = shared_or_mean([getattr(e, name).weight for e in embs], prefix + name, report)
    for k, v in member_norm([e.LayerNorm.weight for e in embs], [e.LayerNorm.bias for e in embs]).items():
        sd[f"{prefix}emb_norm.{k}"] = v
    c = berts[0].config
    hd = c.hidden_size // c.num_attention_heads
    layers = [b.encoder.layer for b in berts]
    return fuse_blocks(f"{prefix}encoder.blocks", layers, bert_layer_weights, hd, mlp, report, sd)


class BertAdapter(FamilyAdapter):
    row = BERT
    base_loader = "huggingface"
    lora_targets = r".*attention\.(self\.(query|key|value)|output\.dense)"

    def logits(self, model: nn.Module, batch: dict[str, torch.Tensor], **kwargs: Any) -> torch.Tensor:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs).logits

    def config_heads(self, config: dict[str, Any]) -> list[int] | None:
        return [int(config["num_attention_heads"])] * int(config["num_hidden_layers"])

    check = staticmethod(check_supported)

    @staticmethod
    def _layers(model: nn.Module) -> nn.ModuleList:
        return model.bert.encoder.layer

    def layer_modules(self, model: nn.Module) -> list[nn.Module]:
        return list(self._layers(model))

    def num_layers(self, model: nn.Module) -> int:
        return len(self._layers(model))

    def head_dim(self, model: nn.Module) -> int:
        return model.config.hidden_size // model.config.num_attention_heads

    def heads(self, model: nn.Module) -> list[int]:
        hd = self.head_dim(model)
        return [layer.attention.output.dense.in_features // hd for layer in self._layers(model)]

    def out_proj(self, model: nn.Module, layer: int) -> nn.Linear:
        return self._layers(model)[layer].attention.output.dense

    def qkv_weights(self, model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self._layers(model)[layer].attention.self
        return s.query.weight, s.key.weight, s.value.weight

    def qkv_grads(self, model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self._layers(model)[layer].attention.self
        grads = (s.query.weight.grad, s.key.weight.grad, s.value.weight.grad)
        if any(g is None for g in grads):
            raise RuntimeError(f"no gradient on layer {layer} q/k/v: run a backward pass first")
        return grads

    def _slice_layer(self, model: nn.Module, layer: int, keep: Sequence[int]) -> None:
        att = self._layers(model)[layer].attention
        hd = self.head_dim(model)
        rows = torch.tensor([h * hd + c for h in keep for c in range(hd)], dtype=torch.long)
        dense = att.output.dense
        new_dense = nn.Linear(len(rows), dense.out_features, bias=dense.bias is not None)
        with torch.no_grad():
            new_dense.weight.copy_(dense.weight[:, rows])
            if dense.bias is not None:
                new_dense.bias.copy_(dense.bias)
        att.output.dense = new_dense.to(dense.weight)
        if not keep:
            att.self = ZeroSelfAttention()
            return
        s = att.self
        for name in ("query", "key", "value"):
            old = getattr(s, name)
            new = nn.Linear(old.in_features, len(rows), bias=old.bias is not None)
            with torch.no_grad():
                new.weight.copy_(old.weight[rows])
                if old.bias is not None:
                    new.bias.copy_(old.bias[rows])
            setattr(s, name, new.to(old.weight))
        s.num_attention_heads = len(keep)
        s.all_head_size = len(rows)

    def stem(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        bert = model.bert
        emb = bert.embeddings(input_ids=batch["input_ids"])
        mask, _ = bert._create_attention_masks(
            attention_mask=batch["attention_mask"],
            encoder_attention_mask=None,
            embedding_output=emb,
            encoder_hidden_states=None,
            past_key_values=None,
        )
        return emb, mask

    def block(self, model: nn.Module, layer: int, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        out = self._layers(model)[layer](h, attention_mask=ctx)
        return out[0] if isinstance(out, tuple) else out

    def readout(self, model: nn.Module, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        pooled = model.bert.pooler(h) if model.bert.pooler is not None else h[:, 0]
        return model.classifier(model.dropout(pooled))

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def fused_config(
        self, members: Sequence[nn.Module], mlp: str, report: dict[str, float], sd: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        ref = members[0]
        cfg_hf = ref.config
        num_heads = fuse_bert_encoder([m.bert for m in members], "", mlp, report, sd)
        has_pooler = ref.bert.pooler is not None
        if has_pooler:
            pools = [m.bert.pooler.dense for m in members]
            for k, v in grouped_linear([p.weight for p in pools], [p.bias for p in pools]).items():
                sd[f"pooler.{k}"] = v
        heads = [m.classifier for m in members]
        for k, v in grouped_linear([c.weight for c in heads], [c.bias for c in heads]).items():
            sd[f"classifier.{k}"] = v
        return {
            "arch": self.row.arch,
            "members": len(members),
            "vocab_size": cfg_hf.vocab_size,
            "max_position": cfg_hf.max_position_embeddings,
            "type_vocab_size": cfg_hf.type_vocab_size,
            "dim": cfg_hf.hidden_size,
            "head_dim": self.head_dim(ref),
            "num_heads": num_heads,
            "mlp_hidden": cfg_hf.intermediate_size,
            "num_classes": cfg_hf.num_labels,
            "act": BERT_ACTS[cfg_hf.hidden_act],
            "eps": cfg_hf.layer_norm_eps,
            "qkv_bias": True,
            "mlp": mlp,
            "pooler": has_pooler,
        }
