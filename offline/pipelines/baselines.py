"""The efficient-ensemble baselines a build reports beside Hydra (``base.baselines``), from the same base model, data
and member fine-tuning budget, each a report row scored exactly as Hydra's (:mod:`offline.stages.evaluation`):

* ``lora_ensemble``: M LoRA adapters (``peft``) on the frozen base's attention projections, each with its own seed
  and its own copy of the head, trained one after another for ``hydra.finetune_steps`` steps, run batched as one
  model (``peft``'s mixed-adapter batches: each copy of the batch through its own adapter);
* ``batch_ensemble``: every linear layer of the base made a BatchEnsemble layer (``torch-uncertainty``'s
  ``BatchLinear``: the shared weight with rank-1 factors and a bias per member), fine-tuned from the base as one
  model for ``hydra.finetune_steps`` steps on the batch repeated M times;
* ``laplace``: a last-layer Laplace approximation of Single (``laplace-torch``, Kronecker-factored, prior precision
  by marginal likelihood on the training split), its GLM predictive sampled ``LAPLACE_SAMPLES`` times.

Each returns (logits ``(B, S, C)``, penultimate features ``(B, S, D)``, layer features ``(B, S, L-1, d)``): its
members' (LoRA, BatchEnsemble) or its samples' (Laplace: Single's features, the samples share them), so that the OOD
statistics and scores are fitted and served as they are for Hydra. Packed-Ensembles and MIMO are left out: neither
can start from a pretrained model (docs/build.md, "Baselines").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from offline import train as train_mod
from offline.config import BuildConfig, ConfigError
from offline.families import get_adapter
from offline.stages.datasets import Batch, batches_of, take, with_features
from offline.stages.finetune import member_data, member_train_config

__all__ = [
    "LAPLACE_SAMPLES",
    "LORA_LR_SCALE",
    "LORA_RANK",
    "BatchEnsembleLinear",
    "baseline_methods",
    "batch_ensembled",
    "lora_model",
    "lora_runner",
]

LORA_RANK = 8  # the adapters' rank (alpha = 2 x rank)
LORA_LR_SCALE = 10.0  # LoRA trains at 10x the members' learning rate, as adapters usually do
BE_FACTOR_STD = 0.1  # the rank-1 factors start at 1 + N(0, 0.1^2): members start at the base, a little apart
LAPLACE_SAMPLES = 10  # GLM predictive samples per input
LAPLACE_FIT = 3000  # training examples the Laplace approximation is fitted on (at most)

# (B, S, C) logits, (B, S, D) features, (B, S, L-1, d) layer features
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _head_name(model: nn.Module) -> str:
    return "head" if isinstance(getattr(model, "head", None), nn.Module) else "classifier"


def _forward(family: str) -> Callable[..., torch.Tensor]:
    """``(model, batch, **kwargs) -> logits (B, C)``: the family's plain model call (and peft's around it)."""
    return get_adapter(family).logits


def _repeat(batch: Batch, m: int) -> Batch:
    """Each tensor of ``batch`` repeated ``m`` times along the batch: copy i is rows ``[i B, (i + 1) B)``."""
    return {k: v.repeat(m, *([1] * (v.dim() - 1))) for k, v in batch.items()}


def _as_members(out: tuple[torch.Tensor, ...], m: int) -> Outputs:
    """Outputs of the batch repeated ``m`` times, ``(m B, ...)``, as the members' ``(B, m, ...)``."""
    logits, feats, layers = out

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(m, -1, *t.shape[1:]).transpose(0, 1)

    return split(logits), split(feats), split(layers)


def _train(
    ctx: Any, model: nn.Module, names: Sequence[str], i: int, lr_scale: float, copies: int, desc: str
) -> list[float]:
    """``names`` of ``model`` trained as member ``i`` is (its recipe, data and seed, without distillation: Hydra's
    lever), the learning rate times ``lr_scale``, on each batch repeated ``copies`` times."""
    cfg: BuildConfig = ctx.config
    tcfg = member_train_config(cfg, i, ctx.adapter.num_layers(ctx.base.model))
    over = {"lr": tcfg.lr * lr_scale, "last_blocks": 0, "distill_weight": 0.0, "train_params": tuple(names)}
    tcfg = train_mod.TrainConfig(**{**vars(tcfg), **over})
    data = member_data(ctx.data, cfg, tcfg.seed)
    y = np.asarray(data.train.labels, dtype=np.int64)
    get = train_mod.data_batcher(data.train.inputs, y, ctx.base.preprocessing, ctx.base.tokenizer, tcfg)

    def get_copies(idx: np.ndarray, step: int) -> tuple[Batch, torch.Tensor]:
        batch, labels = get(idx, step)
        return _repeat(batch, copies), labels.repeat(copies)

    fwd = _forward(cfg.family)
    return train_mod.fit(model, lambda m, b: fwd(m, b), get_copies, len(y), tcfg, desc)


# ----------------------------------------------------------------------------- LoRA-Ensembles
def lora_targets(family: str) -> str:
    """The attention projections LoRA adapts (a ``peft`` regex over module names), as the family's adapter says."""
    targets = get_adapter(family).lora_targets
    if not targets:
        raise ConfigError(f"base.baselines: family {family!r} names no LoRA targets")
    return targets


def lora_model(base: nn.Module, family: str, members: int, seed: int) -> tuple[nn.Module, list[str]]:
    """A copy of ``base`` with ``members`` LoRA adapters (``peft``; each with its own copy of the head), the first
    initialised from the random state as it is, each other with its own seed: ``(the peft model, the adapters'
    names)``."""
    from peft import LoraConfig, get_peft_model

    head = _head_name(base)
    names = [f"m{i}" for i in range(members)]

    def config() -> Any:
        return LoraConfig(
            r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=lora_targets(family), modules_to_save=[head]
        )

    model = get_peft_model(copy.deepcopy(base), config(), adapter_name=names[0])
    for i, name in enumerate(names[1:], start=1):
        torch.manual_seed(seed * 1000 + i)  # each adapter's own initialisation
        model.add_adapter(name, config())
    return model, names


def lora_runner(model: nn.Module, names: Sequence[str], family: str) -> Callable[[Batch], torch.Tensor]:
    """``batch repeated M times -> logits (M B, C)``: copy i of the batch through adapter i, in one forward pass."""
    fwd, routes, M = _forward(family), {}, len(names)

    def run(batch: Batch) -> torch.Tensor:
        n = next(iter(batch.values())).shape[0] // M
        route = routes.setdefault(n, [name for name in names for _ in range(n)])
        return fwd(model, batch, adapter_names=route)

    return run


def lora_ensemble(ctx: Any, base: nn.Module, members: int) -> tuple[Callable[[Batch], Outputs], int]:
    """M LoRA adapters on a copy of the frozen ``base``, trained one by one; ``(batch -> outputs, parameters)``."""
    family = ctx.config.family
    model, names = lora_model(base, family, members, ctx.config.data.seed)
    for i, name in enumerate(names):
        model.set_adapter(name)
        own = [n for n, _ in model.named_parameters() if f".{name}." in n]
        _train(ctx, model, own, i, LORA_LR_SCALE, 1, f"LoRA member {i}")
    model.eval()
    inner = model.get_base_model()
    head = getattr(inner, _head_name(base))
    hooked = with_features(lora_runner(model, names, family), inner, ctx.adapter.layer_modules(inner), head=head)
    params = sum(p.numel() for p in base.parameters()) + sum(
        p.numel() for n, p in model.named_parameters() if any(f".{name}." in n for name in names)
    )
    return lambda b: _as_members(hooked(_repeat(b, members)), members), params


# ----------------------------------------------------------------------------- BatchEnsemble
class BatchEnsembleLinear(nn.Module):
    """``torch-uncertainty``'s ``BatchLinear`` over inputs of any rank ``(N, ..., in)``, started from a pretrained
    ``nn.Linear``: its weight shared, member i's rank-1 factors ``r_i``, ``s_i`` at 1 + N(0, ``std``^2) and its bias
    the linear's. Member i reads rows ``[i N / M, (i + 1) N / M)`` of the batch: flattening ``(N, T, in)`` to
    ``(N T, in)`` keeps every sequence's rows with its member."""

    def __init__(self, linear: nn.Linear, members: int, generator: torch.Generator, std: float = BE_FACTOR_STD) -> None:
        super().__init__()
        from torch_uncertainty.layers import BatchLinear

        self.layer = BatchLinear(linear.in_features, linear.out_features, members, bias=linear.bias is not None)
        with torch.no_grad():
            self.layer.linear.weight.copy_(linear.weight)
            for p in (self.layer.r_group, self.layer.s_group):
                p.copy_(1 + std * torch.randn(p.shape, generator=generator))
            if linear.bias is not None:
                self.layer.bias.copy_(linear.bias.expand_as(self.layer.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``BatchLinear``'s arithmetic, ``((x * r_i) W^T) * s_i + b_i`` for member i's rows, with the factors
        broadcast over each member's block of rows instead of repeated row by row (the library's forward makes three
        ``(N, width)`` copies of them per layer, which made a fine-tuning step 20x slower)."""
        layer, M = self.layer, self.layer.num_estimators
        h = x.reshape(M, -1, x.shape[-1])  # (M, N/M, in): member i's rows are the i-th block
        y = F.linear(h * layer.r_group.unsqueeze(1), layer.linear.weight) * layer.s_group.unsqueeze(1)
        if layer.bias is not None:
            y = y + layer.bias.unsqueeze(1)
        return y.view(*x.shape[:-1], -1)


def batch_ensembled(base: nn.Module, members: int, seed: int) -> nn.Module:
    """A copy of ``base`` with every ``nn.Linear`` a :class:`BatchEnsembleLinear` of ``members`` members."""
    model = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, BatchEnsembleLinear(linear, members, g))
    return model


def batch_ensemble(ctx: Any, base: nn.Module, members: int) -> tuple[Callable[[Batch], Outputs], int]:
    """``base`` as a BatchEnsemble, fine-tuned as one model; ``(batch -> outputs, parameters)``."""
    model = batch_ensembled(base, members, ctx.config.data.seed)
    _train(ctx, model, [n for n, _ in model.named_parameters()], 0, 1.0, members, "BatchEnsemble")
    model.eval()
    fwd = _forward(ctx.config.family)
    head = getattr(model, _head_name(model))
    hooked = with_features(lambda b: fwd(model, b), model, ctx.adapter.layer_modules(model), head=head)
    return lambda b: _as_members(hooked(_repeat(b, members)), members), sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- last-layer Laplace
def laplace(ctx: Any, base: nn.Module, samples: int = LAPLACE_SAMPLES) -> tuple[Callable[[Batch], Outputs], int]:
    """A last-layer Laplace approximation of ``base`` (its head, on the penultimate features of up to
    :data:`LAPLACE_FIT` training examples); ``(batch -> outputs, parameters)``: ``samples`` draws of the GLM
    predictive's logits, each with the base's features."""
    from laplace import Laplace

    adapter, data, prep, tok = ctx.adapter, ctx.data, ctx.base.preprocessing, ctx.base.tokenizer
    head_name = _head_name(base)
    features = with_features(lambda b: adapter.forward(base, b), base, adapter.layer_modules(base))
    n = min(LAPLACE_FIT, len(data.train.labels))
    idx = np.random.default_rng([ctx.config.data.seed, 17]).choice(len(data.train.labels), n, replace=False)
    feats, labels = [], []
    with torch.inference_mode():
        for batch, y in batches_of(take(data.train.inputs, idx), data.train.labels[idx], prep, tok, 128):
            feats.append(features(batch)[1].float())
            labels.append(torch.as_tensor(y))
    head = copy.deepcopy(getattr(base, head_name)).float()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(feats), torch.cat(labels)), 256)
    la = Laplace(head, "classification", subset_of_weights="all", hessian_structure="kron")
    la.fit(loader, progress_bar=False)
    la.optimize_prior_precision(method="marglik")
    seed = ctx.config.data.seed

    def run(batch: Batch) -> Outputs:
        logits, feat, layers = features(batch)
        g = torch.Generator(device=feat.device).manual_seed(seed)
        draws = la.functional_samples(feat.float(), n_samples=samples, generator=g)  # (S, B, C)
        S = draws.shape[0]
        rep = lambda t: t.unsqueeze(1).expand(t.shape[0], S, *t.shape[1:])  # noqa: E731
        return draws.transpose(0, 1).to(logits.dtype), rep(feat), rep(layers)

    C, D = head.weight.shape
    factors = (D + int(head.bias is not None)) ** 2 + C**2  # the posterior's two Kronecker factors
    return run, sum(p.numel() for p in base.parameters()) + factors


def baseline_methods(ctx: Any, base: nn.Module) -> dict[str, tuple[Callable[[Batch], Outputs], int]]:
    """``base.baselines`` built from the base model: name -> (batch -> outputs, parameters)."""
    out = {}
    members = ctx.config.hydra.members
    for name in ctx.config.base.baselines:
        with torch.random.fork_rng():  # the build's random state after them is what it is without them
            if name == "lora_ensemble":
                out[name] = lora_ensemble(ctx, base, members)
            elif name == "batch_ensemble":
                out[name] = batch_ensemble(ctx, base, members)
            else:
                out[name] = laplace(ctx, base)
        ctx.timer.lap(f"baseline {name}")
    return out
