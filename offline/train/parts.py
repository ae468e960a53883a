"""Which parameters train: a model's parameters by part (attention, MLP, norms, head, embeddings).

``TrainConfig.unfreeze`` names the parts that train (``"all"`` or e.g. ``"attention+mlp+norm+head"``); a
parameter's part is read from its name, for timm ViTs and Hugging Face BERTs alike. ``TrainConfig.last_blocks``
narrows it to the last N transformer blocks (``blocks.<i>.`` / ``layer.<i>.``): the parts of earlier blocks and
the embeddings stay frozen, the parts after the blocks (final norm, head) train as ``unfreeze`` says.
"""

from __future__ import annotations

import re

from torch import nn

PARTS = ("attention", "mlp", "norm", "head", "embed")

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layer)\.(\d+)\.")

_BEFORE_BLOCKS = re.compile(r"(^|\.)(embeddings|norm_pre)\.")  # BERT's embedding LayerNorm, timm's pre-norm

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


def block_of(name: str) -> int | None:
    """The transformer block a parameter belongs to (``blocks.3.attn.qkv.weight`` -> 3), None outside the blocks."""
    m = _BLOCK.search(name)
    return int(m.group(1)) if m else None


def trainable_names(model: nn.Module, spec: str, last_blocks: int = 0) -> list[str]:
    """Names of the parameters of ``model`` that train under ``unfreeze=spec`` and ``last_blocks``."""
    parts = unfreeze_parts(spec)
    names = [n for n, _ in model.named_parameters()]
    if parts != set(PARTS):
        names = [n for n in names if param_part(n) in parts]
    if last_blocks > 0:
        blocks = [b for b in map(block_of, (n for n, _ in model.named_parameters())) if b is not None]
        if not blocks:
            raise ValueError("last_blocks: the model has no transformer blocks (blocks.<i>. / layer.<i>.) by name")
        first = max(blocks) + 1 - last_blocks

        def late(name: str) -> bool:  # in one of the last blocks, or after them (not what comes before them)
            b = block_of(name)
            return b >= first if b is not None else not _BEFORE_BLOCKS.search(name) and param_part(name) != "embed"

        names = [n for n in names if late(n)]
    return names
