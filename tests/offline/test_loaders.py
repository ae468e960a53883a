"""The base models' loaders: a user's checkpoint with a 1000-class head builds with the data's class count, renamed
keys stop the build; the packaged MiniLM and a local Hugging Face folder load offline."""

from __future__ import annotations

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

from offline.config import ConfigError
from offline.models.loaders import check_keys, load_minilm_classifier, load_timm, minilm_path

from .conftest import save_minilm_like, tiny_bert

VIT = "vit_tiny_patch16_224"


# ----------------------------------------------------------------------------- timm
@pytest.fixture(scope="module")
def timm_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A timm ViT in the standard layout with random weights and the usual 1000-class head, as .safetensors."""
    torch.manual_seed(0)
    model = timm.create_model(VIT, pretrained=False, num_classes=1000)
    path = tmp_path_factory.mktemp("timm") / "vit.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path, model


def test_a_1000_class_checkpoint_builds_with_the_datas_class_count(timm_checkpoint):
    path, source = timm_checkpoint
    model = load_timm(VIT, path, num_classes=3)
    assert model.get_classifier().out_features == 3
    # every backbone weight is the checkpoint's
    torch.testing.assert_close(model.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)
    torch.testing.assert_close(model.pos_embed, source.pos_embed)


def test_renamed_keys_stop_the_build_naming_them(timm_checkpoint, tmp_path):
    path, _ = timm_checkpoint
    state = load_file(str(path))
    renamed = {k.replace("blocks.0.", "layers.0."): v for k, v in state.items()}
    bad = tmp_path / "renamed.safetensors"
    save_file(renamed, str(bad))
    with pytest.raises(ConfigError, match=r"missing \(e\.g\. blocks\.0\..*unexpected \(e\.g\. layers\.0\."):
        load_timm(VIT, bad, num_classes=3)
    with pytest.raises(ConfigError, match="cannot read a state dict"):
        (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
        load_timm(VIT, tmp_path / "junk.safetensors", num_classes=3)
    with pytest.raises(ConfigError, match="is not a file"):
        load_timm(VIT, tmp_path / "nope.safetensors", num_classes=3)


def test_check_keys_lets_only_the_head_differ():
    check_keys("ckpt", {"head.weight"}, {"head.bias"}, head=["head."])  # the head may be new
    with pytest.raises(ConfigError, match="1 missing"):
        check_keys("ckpt", {"head.weight", "norm.weight"}, set(), head=["head."])
    with pytest.raises(ConfigError, match="1 unexpected"):
        check_keys("ckpt", set(), {"extra.weight"})


# ----------------------------------------------------------------------------- BERT / MiniLM
def test_a_hugging_face_folder_with_a_1000_label_head_and_one_with_renamed_keys(tmp_path):
    save_minilm_like(tmp_path / "ok", hidden=32, heads=2)
    model, _ = load_minilm_classifier(3, path=str(tmp_path / "ok"))
    assert model.classifier.out_features == 3
    state = load_file(str(tmp_path / "ok" / "model.safetensors"))
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    for f in (tmp_path / "ok").iterdir():
        if f.name != "model.safetensors":
            (bad_dir / f.name).write_bytes(f.read_bytes())
    renamed = {k.replace("encoder.layer.1.", "encoder.block.1."): v for k, v in state.items()}
    save_file(renamed, str(bad_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"missing \(e\.g\. bert\.encoder\.layer\.1\."):
        load_minilm_classifier(3, path=str(bad_dir))


def test_load_packaged_minilm_offline():
    model, tok = load_minilm_classifier(3)
    from transformers import BertForSequenceClassification

    assert isinstance(model, BertForSequenceClassification)
    assert model.config.num_attention_heads == 12 and model.config.num_hidden_layers == 6
    assert model.classifier.out_features == 3 and model.config._attn_implementation == "eager"
    assert tok("hello world")["input_ids"] == [101, 7592, 2088, 102]


def test_load_classifier_from_local_folder(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path())
    tiny_bert(num_labels=2).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, tok2 = load_minilm_classifier(4, path=str(tmp_path))
    assert model.classifier.out_features == 4 and model.config.num_hidden_layers == 3
    assert tok2("hello")["input_ids"] == tok("hello")["input_ids"]
    with pytest.raises(ValueError, match="cannot load a text classifier"):
        load_minilm_classifier(2, path=str(tmp_path / "missing"))
