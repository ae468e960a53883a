"""Which parameters train: a model's parameters by part (attention, MLP, norms, head, embeddings).

``TrainConfig.unfreeze`` names the parts that train (``"all"`` or e.g. ``"attention+mlp+norm+head"``); a
parameter's part is read from its name, for timm ViTs and Hugging Face BERTs alike.
"""

from __future__ import annotations

import re

from torch import nn

PARTS = ("attention", "mlp", "norm", "head", "embed")

_PART_RULES = (  # first match wins
    ("norm", re.compile(r"(^|\.)(norm\d?|norm_pre|fc_norm|LayerNorm)\.")),
    ("attention", re.compile(r"\.(attn|attention)\.|\.ls1\.")),
    ("mlp", re.compile(r"\.(mlp|intermediate|output)\.|\.ls2\.")),
    ("head", re.compile(r"^(head|classifier|bert\.pooler)\.")),
    ("embed", re.compile(r"(^|\.)(cls_token|pos_embed|patch_embed|embeddings)($|\.)|_embeddings\.")),
)


def unfreeze_parts(spec: str) -> set[str]:
    """``"all"`` or ``"attention+mlp+norm+head"`` -> the set of part names; unknown names raise ValueError."""
    if spec.strip() == "all":
        return set(PARTS)
    parts = {p.strip() for p in spec.split("+") if p.strip()}
    bad = parts - set(PARTS)
    if bad or not parts:
        raise ValueError(f"unfreeze {spec!r}: unknown parts {sorted(bad)}; use 'all' or '+'-joined {', '.join(PARTS)}")
    return parts


def param_part(name: str) -> str:
    """The part (attention, mlp, norm, head, embed) a timm ViT or HF BERT parameter belongs to."""
    for part, rx in _PART_RULES:
        if rx.search(name):
            return part
    raise ValueError(f"cannot tell which part ({', '.join(PARTS)}) parameter {name!r} belongs to")


def trainable_names(model: nn.Module, spec: str) -> list[str]:
    """Names of the parameters of ``model`` that train under ``unfreeze=spec``."""
    parts = unfreeze_parts(spec)
    if parts == set(PARTS):
        return [n for n, _ in model.named_parameters()]
    return [n for n, _ in model.named_parameters() if param_part(n) in parts]
