"""LiT: an OpenCLIP CustomTextCLIP with a frozen Hugging Face text tower, image tower trained on captions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offline.data import Data, Split
from offline.models.loaders import minilm_path
from offline.train import TrainConfig, lit

VISION = {"image_size": 28, "patch_size": 7, "width": 32, "layers": 2, "head_width": 8, "mlp_ratio": 2.0}
CLASSES = ["top-left square", "bottom-right square", "horizontal bar"]
PREP = {"mean": [0.5] * 3, "std": [0.5] * 3, "size": [28, 28], "channels": 3}


def _text_tower(folder) -> str:
    """A tiny random BERT saved as a local HF folder, with MiniLM's (packaged) tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(
        BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64
        ),
        add_pooling_layer=False,
    ).save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(folder)
    return str(folder)


def _shapes(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three visually distinct classes of 28x28 uint8 images with noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
    for i, c in enumerate(y):
        if c == 0:
            x[i, 2:12, 2:12] = 250
        elif c == 1:
            x[i, 16:26, 16:26] = 250
        else:
            x[i, 12:16, :] = 250
    return x, y.astype(np.int64)


def test_lit_trains_the_image_tower_against_the_frozen_text_tower(tmp_path):
    import open_clip

    cfg = lit.lit_model_config(VISION, text_path=_text_tower(tmp_path / "text"))
    assert cfg["embed_dim"] == 32 and cfg["text_cfg"]["hf_proj_type"] is None  # the text tower's own space
    model = lit.make_lit_model(cfg, pretrained_text=True)
    from transformers import BertModel

    saved = BertModel.from_pretrained(str(tmp_path / "text"), add_pooling_layer=False)
    for k, v in saved.state_dict().items():  # the pretrained text tower was loaded, offline
        torch.testing.assert_close(model.text.transformer.state_dict()[k], v)
    tok = lit.load_tokenizer(cfg)
    text_before = {k: v.clone() for k, v in model.text.state_dict().items()}
    vision_before = {k: v.clone() for k, v in model.visual.state_dict().items()}
    x, y = _shapes(384, 0)
    xv, yv = _shapes(120, 1)
    chance = lit.zero_shot_accuracy(model, tok, CLASSES, Split(xv, yv), PREP)
    tcfg = TrainConfig(steps=60, batch_size=32, lr=3e-3, warmup_frac=0.1, label_smoothing=0.0, progress=False)
    lit.train_lit(model, tok, Data("image", CLASSES, Split(x, y), Split(xv, yv), Split(xv, yv), {}, {}, {}), tcfg, PREP)
    info = getattr(model, lit.LIT_TRAIN_LOG_ATTR)
    assert info["val_zero_shot_accuracy"] > 0.9 > chance + 0.2
    assert info["val_zero_shot_accuracy"] == lit.zero_shot_accuracy(model, tok, CLASSES, Split(xv, yv), PREP)
    for k, v in model.text.state_dict().items():
        assert torch.equal(v, text_before[k]), f"text tower changed: {k}"
    assert any(not torch.equal(v, vision_before[k]) for k, v in model.visual.state_dict().items())
    assert all(isinstance(b.attn, torch.nn.MultiheadAttention) for b in model.visual.transformer.resblocks)
    # an ordinary OpenCLIP model: open_clip's own loader reads it back
    cfg_path, weights = lit.save_openclip(model, cfg, tmp_path / "ckpt", "lit-test-tiny")
    open_clip.add_model_config(cfg_path)
    again = open_clip.create_model("lit-test-tiny", pretrained=str(weights)).eval()
    ids = lit.tokenize_prompts(tok, lit.prompts(CLASSES))["input_ids"]
    px = lit.pixel_batch(xv[:4], PREP["mean"], PREP["std"], PREP["size"])
    with torch.no_grad():
        torch.testing.assert_close(again.encode_image(px), model.encode_image(px))
        torch.testing.assert_close(again.encode_text(ids), model.encode_text(ids))


def test_packaged_minilm_is_the_text_tower_offline():
    """The real LiT text tower: all-MiniLM-L6-v2 through open_clip's HF tower, mean pooled, = its sentence space."""
    from transformers import AutoModel

    cfg = lit.lit_model_config(lit.LIT_PRESETS["lit_fast"]["vision"])
    model = lit.make_lit_model(cfg)
    tok = lit.load_tokenizer(cfg)
    assert cfg["embed_dim"] == 384 and isinstance(model.text.proj, torch.nn.Identity)
    batch = lit.tokenize_prompts(tok, lit.prompts(["Trouser", "Bag"]))
    ref = AutoModel.from_pretrained(minilm_path()).eval()
    with torch.no_grad():
        h = ref(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        expected = torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)
        torch.testing.assert_close(model.encode_text(batch["input_ids"], normalize=True), expected, atol=1e-5, rtol=0)
    from offline.families import get_adapter

    assert get_adapter("clip").heads(model) == [4] * 4 + [12] * 6  # 16 vision heads, then MiniLM's 72


@pytest.mark.parametrize("preset", sorted(lit.LIT_PRESETS))
def test_presets_share_minilm_head_width(preset):
    v = lit.LIT_PRESETS[preset]["vision"]
    assert v["head_width"] == 32 and v["width"] % 32 == 0  # MiniLM: 384 / 12 heads


def test_image_tower_starts_exactly_from_a_timm_vit_checkpoint(tmp_path):
    """base.image_init: a timm ViT of one grey channel, with a patch bias, becomes the open_clip tower that gives the
    same final-norm class token on the grey image sent as RGB (the LiT input); a mismatch is refused by name."""
    from safetensors.torch import save_file
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(3)
    arch = {
        "img_size": 28,
        "patch_size": 7,
        "in_chans": 1,
        "embed_dim": 32,
        "depth": 2,
        "num_heads": 4,
        "mlp_ratio": 2.0,
        "num_classes": 3,
    }
    timm_vit = VisionTransformer(**arch).eval()
    with torch.no_grad():
        for p in timm_vit.parameters():
            p.add_(0.05 * torch.randn_like(p))  # no zero biases, no unit norms: every tensor must land
    path = tmp_path / "backbone.safetensors"
    save_file({k: v.contiguous() for k, v in timm_vit.state_dict().items()}, str(path))
    vision = {**VISION, "no_ln_pre": True, "norm_kwargs": {"eps": 1e-6}}
    model = lit.make_lit_model(lit.lit_model_config(vision, text_path=_text_tower(tmp_path / "text")))
    rec = lit.init_image_tower(model, path)
    assert rec["tensors"] == 5 + 2 * 12  # stem (5 tensors) and 12 per block
    seen = []
    hook = model.visual.ln_post.register_forward_hook(lambda mod, args, out: seen.append(out))
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        model.visual(x.expand(-1, 3, -1, -1))
        want = timm_vit.forward_features(x)[:, 0]
    hook.remove()
    torch.testing.assert_close(seen[0][:, 0], want, atol=1e-5, rtol=1e-5)
    wide = lit.make_lit_model(lit.lit_model_config({**vision, "width": 64}, text_path=str(tmp_path / "text")))
    with pytest.raises(ValueError, match="does not fit the image tower"):
        lit.init_image_tower(wide, path)
    with_ln_pre = lit.make_lit_model(lit.lit_model_config(VISION, text_path=str(tmp_path / "text")))
    with pytest.raises(ValueError, match="without ln_pre"):
        lit.init_image_tower(with_ln_pre, path)
