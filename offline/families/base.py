"""What every model family adapter provides to scoring, pruning and fusion.

An adapter is a stateless object that knows one family's module layout. Models
stay the family's own classes (timm ``VisionTransformer``, Hugging Face
``BertForSequenceClassification``); pruned members are structurally sliced copies
of them, so a member can always be run and checked on its own.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from service.core.families import Family

# The base model's head indices each layer still holds, recorded on pruned copies.
KEPT_ATTR = "_hydra_kept_heads"


class ZeroHeadOutput(nn.Module):
    """Stand-in for an attention whose heads were all pruned: its output is empty ``(B, T, 0)``."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], 0)


class FamilyAdapter:
    """Base class: a subclass declares everything about its family, in its one file.

    * ``row``: its row of :data:`service.core.families.FAMILIES` (name, task, modality, the fused module's arch, what
      it supports): the manifest, the config checks and the server read the row, the pipeline is the task's
      (:data:`offline.build.PIPELINES`);
    * ``base_loader``: which base model loader of :data:`offline.pipelines.bases.BASE_LOADERS` makes its base model;
    * ``lora_targets``: the attention projections LoRA adapts (a ``peft`` regex over module names; the baselines);
    * the structure accessors below (head counting, slicing, fusion), :meth:`logits` (a plain model call, for the
      baselines) and :meth:`config_heads` (head counts from a Hugging Face ``config.json``).

    A subclass in ``offline/families/`` is registered by :mod:`offline.families` at import.
    """

    row: Family
    name: str = "base"  # row.name, set for each subclass that declares a row
    base_loader: str = ""
    lora_targets: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "row" in vars(cls):
            cls.name = cls.row.name

    def logits(self, model: nn.Module, batch: dict[str, torch.Tensor], **kwargs: Any) -> torch.Tensor:
        """Logits ``(B, C)`` of a plain call of ``model`` (the family's own class, or peft around it) on ``batch``."""
        raise NotImplementedError(f"family {self.name!r} has no plain model call")

    def config_heads(self, config: dict[str, Any]) -> list[int] | None:
        """Head counts per layer read from a Hugging Face ``config.json`` of the family; None when it has none."""
        return None

    # -- structure -----------------------------------------------------------------
    def num_layers(self, model: nn.Module) -> int:
        raise NotImplementedError

    def head_dim(self, model: nn.Module) -> int:
        raise NotImplementedError

    def layer_head_dim(self, model: nn.Module, layer: int) -> int:
        """Width of the heads of ``layer``: :meth:`head_dim` unless a family's layers differ."""
        return self.head_dim(model)

    def heads(self, model: nn.Module) -> list[int]:
        """Current number of heads per layer."""
        raise NotImplementedError

    def layer_modules(self, model: nn.Module) -> list[nn.Module]:
        """The model's blocks in order (their outputs, pooled over the tokens, are the layer features)."""
        raise NotImplementedError

    def out_proj(self, model: nn.Module, layer: int) -> nn.Linear:
        """The attention output projection of ``layer``; weight ``(d, H*hd)``, head h = columns h*hd:(h+1)*hd."""
        raise NotImplementedError

    def qkv_weights(self, model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Wq, Wk, Wv) of ``layer`` as ``(H*hd, d)`` views of the parameters (rows grouped by head)."""
        raise NotImplementedError

    def qkv_grads(self, model: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of the loss w.r.t. (Wq, Wk, Wv), same shapes as :meth:`qkv_weights`."""
        raise NotImplementedError

    def _slice_layer(self, model: nn.Module, layer: int, keep: Sequence[int]) -> None:
        """Structurally keep only heads ``keep`` (indices into the layer's current heads), in place."""
        raise NotImplementedError

    # -- running ---------------------------------------------------------------------
    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits ``(B, C)``."""
        h, ctx = self.stem(model, batch)
        for layer in range(self.num_layers(model)):
            h = self.block(model, layer, h, ctx)
        return self.readout(model, h, ctx)

    def stem(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """Embeddings: hidden states before layer 0 and a context (masks) for the blocks."""
        raise NotImplementedError

    def block(self, model: nn.Module, layer: int, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError

    def readout(self, model: nn.Module, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError

    # -- fusion --------------------------------------------------------------------------
    def check(self, model: nn.Module) -> None:
        """Raise TypeError / ValueError naming what of ``model`` the fused model does not implement."""
        raise NotImplementedError

    def fused_config(
        self, members: Sequence[nn.Module], mlp: str, report: dict[str, float], sd: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        """The fused config of checked ``members``, their fused state dict written into ``sd``.

        Shared parameters the members disagree on are averaged and recorded in ``report`` (name -> largest
        difference).
        """
        raise NotImplementedError

    def to_fused(self, members: Sequence[nn.Module], mlp: str = "shared") -> tuple[dict, dict[str, torch.Tensor]]:
        """Fused config and state dict (for ``service.core.registry.build_model``) of structurally pruned members.

        Every member is checked first. The config's ``averaged_shared_params`` names the shared parameters
        the members disagree on (averaged by the fusion) with their largest difference.
        """
        for m in members:
            self.check(m)
        report: dict[str, float] = {}
        sd: dict[str, torch.Tensor] = {}
        cfg = self.fused_config(members, mlp, report, sd)
        return {**cfg, "averaged_shared_params": report}, sd

    # -- shared machinery -----------------------------------------------------------------
    def kept_heads(self, model: nn.Module) -> list[list[int]]:
        """Base-model head indices each layer of ``model`` holds."""
        kept = getattr(model, KEPT_ATTR, None)
        if kept is None:
            kept = [list(range(h)) for h in self.heads(model)]
        return [list(k) for k in kept]

    def prune(self, model: nn.Module, keep: Sequence[Sequence[int]]) -> nn.Module:
        """A structurally pruned deep copy keeping, per layer, the given *current* head indices."""
        heads = self.heads(model)
        if len(keep) != len(heads):
            raise ValueError(f"keep lists {len(keep)} layers, the model has {len(heads)}")
        base_kept = self.kept_heads(model)
        pruned = copy.deepcopy(model)
        new_kept = []
        for layer, (k, n) in enumerate(zip(keep, heads, strict=True)):
            k = sorted(int(i) for i in k)
            if len(set(k)) != len(k) or any(i < 0 or i >= n for i in k):
                raise ValueError(f"layer {layer}: kept heads {k} are not distinct indices in [0, {n})")
            if k != list(range(n)):
                self._slice_layer(pruned, layer, k)
            new_kept.append([base_kept[layer][i] for i in k])
        setattr(pruned, KEPT_ATTR, new_kept)
        # the sliced layers are new modules made on the CPU: the pruned copy lives where the model lives (a GPU build)
        return pruned.to(next(model.parameters()).device)

    def prune_to(self, model: nn.Module, keep_base: Sequence[Sequence[int]]) -> nn.Module:
        """Like :meth:`prune` but with *base-model* head indices."""
        base_kept = self.kept_heads(model)
        keep = []
        for layer, k in enumerate(keep_base):
            pos = {h: i for i, h in enumerate(base_kept[layer])}
            missing = [h for h in k if h not in pos]
            if missing:
                raise ValueError(f"layer {layer}: heads {missing} are already pruned")
            keep.append([pos[h] for h in k])
        return self.prune(model, keep)

    @contextlib.contextmanager
    def ablate(self, model: nn.Module, heads: dict[int, Sequence[int]]) -> Iterator[None]:
        """Temporarily turn heads off by zeroing their output-projection columns (the paper's AblateTemp).

        ``heads``: {layer: [head]}; a head's columns are as wide as :meth:`layer_head_dim` of its layer.
        """
        saved = []
        with torch.no_grad():
            for layer, hs in heads.items():
                hd = self.layer_head_dim(model, layer)
                w = self.out_proj(model, layer).weight
                for h in hs:
                    cols = slice(h * hd, (h + 1) * hd)
                    saved.append((w, cols, w[:, cols].clone()))
                    w[:, cols] = 0
        try:
            yield
        finally:
            with torch.no_grad():
                for w, cols, val in reversed(saved):
                    w[:, cols] = val


def stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.detach().float() for t in tensors])


def shared_or_mean(tensors: Sequence[torch.Tensor], name: str, report: dict[str, float]) -> torch.Tensor:
    """Members' copies of a shared parameter; averaged (and recorded) when they differ."""
    first = tensors[0].detach().float()
    diff = max(float((t.detach().float() - first).abs().max()) for t in tensors)
    if diff > 0:
        report[name] = diff
    return stack(tensors).mean(0)


def grouped_qkv(
    members_qkv: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    members_bias: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None],
    head_dim: int,
) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """Stack members' per-head q/k/v into the fused ``(M, d, 3*Hp*hd)`` layout, zero-padding heads.

    Each member gives ``(Wq, Wk, Wv)`` of shape ``(h_m*hd, d)``; the fused output
    index of (slot s in q/k/v, head j, channel c) is ``s*Hp*hd + j*hd + c``.
    """
    hp = max(q.shape[0] // head_dim for q, _, _ in members_qkv)
    M, d = len(members_qkv), members_qkv[0][0].shape[1]
    w = torch.zeros(M, 3, hp * head_dim, d)
    b = torch.zeros(M, 3, hp * head_dim) if members_bias[0] is not None else None
    for m, qkv in enumerate(members_qkv):
        for s, t in enumerate(qkv):
            w[m, s, : t.shape[0]] = t.detach().float()
            if b is not None:
                bt = members_bias[m][s]
                b[m, s, : bt.shape[0]] = bt.detach().float()
    w = w.reshape(M, 3 * hp * head_dim, d).transpose(1, 2).contiguous()  # (M, d, 3*Hp*hd)
    if b is not None:
        b = b.reshape(M, 1, 3 * hp * head_dim)
    return hp, w, b


def grouped_out(members_w: Sequence[torch.Tensor], hp: int, head_dim: int) -> torch.Tensor:
    """Members' output projections ``(d, h_m*hd)`` -> fused ``(M, Hp*hd, d)`` with zero rows for padded heads."""
    M, d = len(members_w), members_w[0].shape[0]
    w = torch.zeros(M, hp * head_dim, d)
    for m, wm in enumerate(members_w):
        w[m, : wm.shape[1]] = wm.detach().float().t()
    return w


def grouped_linear(ws: Sequence[torch.Tensor], bs: Sequence[torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """nn.Linear weights ``(out, in)`` of M members -> GroupedLinear ``weight (M, in, out)``, ``bias (M, 1, out)``."""
    out = {"weight": torch.stack([w.detach().float().t() for w in ws]).contiguous()}
    if bs is not None:
        out["bias"] = torch.stack([b.detach().float() for b in bs]).unsqueeze(1)
    return out


def member_norm(ws: Sequence[torch.Tensor], bs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """LayerNorm affine of M members -> MemberLayerNorm ``(M, 1, d)``."""
    return {"weight": stack(ws).unsqueeze(1), "bias": stack(bs).unsqueeze(1)}


def layer_weights(
    qkv: Sequence[torch.Tensor],
    qkv_bias: Sequence[torch.Tensor] | None,
    proj: nn.Linear,
    norm1: nn.Module,
    norm2: nn.Module,
    fc1: nn.Linear,
    fc2: nn.Linear,
    layer_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """One member layer's canonical weights, what :func:`fused_block_state` reads.

    ``qkv``: (Wq, Wk, Wv) ``(h*hd, d)`` each; ``qkv_bias``: their biases or None; ``proj``: the attention
    output projection; ``norm1`` / ``norm2``: the LayerNorms around attention and MLP; ``fc1`` / ``fc2``:
    the MLP; ``layer_scale``: the two LayerScale gammas ``(d,)``, or None.
    """
    ls1, ls2 = layer_scale if layer_scale is not None else (None, None)
    return {
        "qkv": qkv,
        "qkv_bias": qkv_bias,
        "proj_w": proj.weight,
        "proj_b": proj.bias,
        "ln1_w": norm1.weight,
        "ln1_b": norm1.bias,
        "ln2_w": norm2.weight,
        "ln2_b": norm2.bias,
        "fc1_w": fc1.weight,
        "fc1_b": fc1.bias,
        "fc2_w": fc2.weight,
        "fc2_b": fc2.bias,
        "ls1": ls1,
        "ls2": ls2,
    }


def fuse_blocks(
    prefix: str,
    member_blocks: Sequence[Sequence[nn.Module]],
    weights_of: Callable[[nn.Module], dict[str, Any]],
    head_dim: int,
    mlp: str,
    report: dict[str, float],
    sd: dict[str, torch.Tensor],
) -> list[int]:
    """The fused blocks ``{prefix}.{i}`` of M members' layer stacks, into ``sd``; the padded head count per layer.

    ``member_blocks[m][i]`` is member m's layer i and ``weights_of`` its canonical weights (:func:`layer_weights`).
    """
    num_heads = []
    for i in range(len(member_blocks[0])):
        hp, bsd = fused_block_state(f"{prefix}.{i}", [weights_of(b[i]) for b in member_blocks], head_dim, mlp, report)
        num_heads.append(hp)
        sd.update(bsd)
    return num_heads


def fused_block_state(
    prefix: str,
    layers: Sequence[dict[str, Any]],
    head_dim: int,
    mlp: str,
    report: dict[str, float],
) -> tuple[int, dict[str, torch.Tensor]]:
    """State dict of one :class:`service.core.fused.FusedBlock` from M members' canonical layer weights.

    Each ``layers[m]`` holds: ``qkv`` (Wq, Wk, Wv) ``(h*hd, d)`` each, ``qkv_bias`` (3 biases or None),
    ``proj_w`` ``(d, h*hd)``, ``proj_b`` ``(d,)``, ``ln1_w/ln1_b/ln2_w/ln2_b``, ``fc1_w/fc1_b/fc2_w/fc2_b``
    and optionally ``ls1/ls2`` ``(d,)``.
    """
    sd: dict[str, torch.Tensor] = {}
    hp = max(lw["qkv"][0].shape[0] // head_dim for lw in layers)
    if hp > 0:
        hp, w, b = grouped_qkv([lw["qkv"] for lw in layers], [lw["qkv_bias"] for lw in layers], head_dim)
        sd[f"{prefix}.attn.qkv.weight"] = w
        if b is not None:
            sd[f"{prefix}.attn.qkv.bias"] = b
        sd[f"{prefix}.attn.proj.weight"] = grouped_out([lw["proj_w"] for lw in layers], hp, head_dim)
        sd[f"{prefix}.attn.proj.bias"] = stack([lw["proj_b"] for lw in layers]).unsqueeze(1)
    else:
        sd[f"{prefix}.attn.proj_bias"] = stack([lw["proj_b"] for lw in layers]).unsqueeze(1)
    for n in ("1", "2"):
        for k, v in member_norm([lw[f"ln{n}_w"] for lw in layers], [lw[f"ln{n}_b"] for lw in layers]).items():
            sd[f"{prefix}.norm{n}.{k}"] = v
    for fc in ("fc1", "fc2"):
        ws, bs = [lw[f"{fc}_w"] for lw in layers], [lw[f"{fc}_b"] for lw in layers]
        if mlp == "shared":
            # the paper's merged MLP: the average of the members' weights and biases
            sd[f"{prefix}.mlp.{fc}.weight"] = shared_or_mean(ws, f"{prefix}.mlp.{fc}.weight", report)
            sd[f"{prefix}.mlp.{fc}.bias"] = shared_or_mean(bs, f"{prefix}.mlp.{fc}.bias", report)
        elif mlp == "per_member":
            for k, v in grouped_linear(ws, bs).items():
                sd[f"{prefix}.mlp.{fc}.{k}"] = v
        else:
            raise ValueError(f"mlp must be 'shared' or 'per_member', got {mlp!r}")
    if layers[0].get("ls1") is not None:
        sd[f"{prefix}.ls1"] = stack([lw["ls1"] for lw in layers]).unsqueeze(1)
        sd[f"{prefix}.ls2"] = stack([lw["ls2"] for lw in layers]).unsqueeze(1)
    return hp, sd
