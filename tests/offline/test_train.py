"""Training: batch preprocessing known answers, which parameters train, loss goes down, exact checkpoint resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from offline import train as T
from offline.data import Data, Split
from offline.families import get_adapter
from offline.train import checkpoints

from .conftest import tiny_bert, tiny_vit


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models train fastest on one thread; on a shared 2-core machine two threads mostly wait on each other."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(T.minilm_path())


def _toy_images(n: int, seed: int = 0, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Two easy classes: background noise only (0), or with ink in the top or the bottom half (1)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.integers(0, 60, (n, size, size)).astype(np.uint8)
    for i in np.flatnonzero(y):
        rows = slice(0, size // 2) if rng.random() < 0.5 else slice(size // 2, size)
        x[i, rows] = rng.integers(180, 256, (size // 2, size))
    return x, y.astype(np.int64)


def _image_data(n: int = 96, size: int = 16) -> Data:
    x, y = _toy_images(n, 0, size)
    xv, yv = _toy_images(32, 1, size)
    return Data("image", ["blank", "ink"], Split(x, y), Split(xv, yv), Split(xv, yv), {}, {}, {})


IMAGE_PREP = {"type": "image", "size": [16, 16], "mean": [0.5], "std": [0.25], "channels": 1}


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


# ----------------------------------------------------------------------------- batches
def test_make_batches_image_normalisation_known_answer():
    x = np.zeros((5, 4, 4), dtype=np.uint8)
    x[:, :2] = 255
    batches = T.make_batches(x, [0, 1, 2, 3, 4], 2, "image", mean=[0.5], std=[0.25])
    assert [len(y) for _, y in batches] == [2, 2, 1]
    pv = batches[0][0]["pixel_values"]
    assert pv.dtype == torch.float32 and pv.shape == (2, 1, 4, 4)
    assert torch.equal(pv[:, :, :2], torch.full((2, 1, 2, 4), 2.0))  # (1 - 0.5) / 0.25
    assert torch.equal(pv[:, :, 2:], torch.full((2, 1, 2, 4), -2.0))  # (0 - 0.5) / 0.25
    assert batches[2][1].dtype == torch.int64 and batches[2][1].tolist() == [4]


def test_make_batches_channels_resize_and_rgb():
    gray = np.full((2, 8, 8), 51, dtype=np.uint8)  # 0.2
    ((b, _),) = T.make_batches(gray, [0, 1], 4, "image", mean=[0.1, 0.2, 0.3], std=[0.5, 0.5, 0.5], size=16, channels=3)
    pv = b["pixel_values"]
    assert pv.shape == (2, 3, 16, 16)
    assert torch.allclose(pv[:, :, 5, 7], torch.tensor([[0.2, 0.0, -0.2]] * 2), atol=1e-6)
    rgb = np.zeros((1, 6, 6, 3), dtype=np.uint8)
    rgb[..., 0] = 255  # pure red, stored (H, W, 3)
    ((b, _),) = T.make_batches(rgb, [0], 1, "image")
    assert b["pixel_values"].shape == (1, 3, 6, 6) and b["pixel_values"][0, 0].min() == 1.0
    assert b["pixel_values"][0, 1:].abs().max() == 0
    ((b, _),) = T.make_batches(rgb, [0], 1, "image", channels=1)
    assert torch.allclose(b["pixel_values"], torch.full((1, 1, 6, 6), 0.299))
    with pytest.raises(ValueError, match="mean/std give 2/2 values for 3-channel"):
        T.make_batches(rgb, [0], 1, "image", mean=[0.1, 0.2], std=[1, 1])


def test_make_batches_text_pads_to_longest_and_truncates(tok):
    texts = ["short", "a somewhat longer sentence with more words in it", "mid length text"]
    batches = T.make_batches(texts, [0, 1, 0], 2, "text", tokenizer=tok, max_length=8)
    (b0, y0), (b1, y1) = batches
    assert set(b0) == {"input_ids", "attention_mask"}
    assert b0["input_ids"].dtype == torch.int64 and b0["attention_mask"].dtype == torch.int64
    assert b0["input_ids"].shape == (2, 8)  # second text truncated to max_length
    assert b0["attention_mask"].sum(1).tolist() == [3, 8]  # [CLS] short [SEP]
    single = tok(["mid length text"], return_tensors="pt")["input_ids"]
    assert torch.equal(b1["input_ids"], single)  # last batch padded only to its own longest, order kept
    assert y0.tolist() == [0, 1] and y1.tolist() == [0]
    with pytest.raises(ValueError, match="need a tokenizer"):
        T.make_batches(texts, [0, 1, 0], 2, "text")


# ----------------------------------------------------------------------------- schedule, sampling, parts
def test_lr_schedule_warmup_then_cosine():
    f = [T.lr_factor(s, 100, 0.1, 0.0) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # linear warm-up over 10 steps
    assert f[10] == pytest.approx(1.0) and f[55] == pytest.approx(0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False)) and f[-1] < 0.001


def test_batch_indices_cover_each_epoch_once():
    epoch = np.concatenate([T.batch_indices(10, 3, s, seed=0) for s in range(3)])
    assert len(set(epoch.tolist())) == 9  # 3 full batches, the partial one dropped
    nxt = np.concatenate([T.batch_indices(10, 3, s, seed=0) for s in range(3, 6)])
    assert not np.array_equal(epoch, nxt)  # a new permutation each epoch
    assert np.array_equal(T.batch_indices(10, 3, 4, seed=0), T.batch_indices(10, 3, 4, seed=0))
    assert T.batch_indices(2, 8, 0, seed=0).tolist() in ([0, 1], [1, 0])  # fewer examples than a batch


def test_every_parameter_has_a_part():
    vit = tiny_vit()
    parts = {n: T.param_part(n) for n, _ in vit.named_parameters()}
    assert parts["cls_token"] == parts["pos_embed"] == parts["patch_embed.proj.weight"] == "embed"
    assert parts["blocks.0.attn.qkv.weight"] == parts["blocks.2.attn.proj.bias"] == "attention"
    assert parts["blocks.1.mlp.fc2.weight"] == "mlp" and parts["head.weight"] == "head"
    assert parts["blocks.0.norm1.weight"] == parts["norm.bias"] == "norm"
    bert = tiny_bert()
    parts = {n: T.param_part(n) for n, _ in bert.named_parameters()}
    L = "bert.encoder.layer.0."
    assert parts[L + "attention.self.query.weight"] == parts[L + "attention.output.dense.weight"] == "attention"
    assert parts[L + "attention.output.LayerNorm.weight"] == parts[L + "output.LayerNorm.bias"] == "norm"
    assert parts[L + "intermediate.dense.weight"] == parts[L + "output.dense.weight"] == "mlp"
    assert parts["bert.embeddings.word_embeddings.weight"] == "embed"
    assert parts["bert.embeddings.LayerNorm.weight"] == "norm"
    assert parts["classifier.weight"] == parts["bert.pooler.dense.weight"] == "head"
    with pytest.raises(ValueError, match="unknown parts"):
        T.TrainConfig(unfreeze="attention+heads")


# ----------------------------------------------------------------------------- training
def test_fit_lowers_the_loss():
    model = tiny_vit(num_classes=2)
    x, y = _toy_images(64)
    ((b, yt),) = T.make_batches(x, y, 64, "image", mean=[0.5], std=[0.25])
    before = F.cross_entropy(model(b["pixel_values"]), yt).item()
    tcfg = T.TrainConfig(steps=25, batch_size=16, lr=1e-3, label_smoothing=0.0, progress=False)
    get = T.data_batcher(x, y, IMAGE_PREP, None, tcfg)
    losses = T.fit(model, T.vit_forward, get, len(y), tcfg)
    with torch.no_grad():
        after = F.cross_entropy(model(b["pixel_values"]), yt).item()
    assert len(losses) == 25 and after < 0.5 * before
    assert not model.training


def test_train_base_vit_learns_a_toy_task():
    x, y = _toy_images(128)
    xv, yv = _toy_images(64, seed=1)
    arch = {
        "img_size": 16,
        "patch_size": 4,
        "in_chans": 1,
        "embed_dim": 32,
        "depth": 1,
        "num_heads": 2,
        "mlp_ratio": 2.0,
        "num_classes": 2,
    }
    tcfg = T.TrainConfig(steps=40, batch_size=32, lr=3e-3, progress=False)
    model = T.train_base_vit(Split(x, y), Split(xv, yv), arch, tcfg, mean=[0.5], std=[0.25])
    from timm.models.vision_transformer import VisionTransformer

    assert isinstance(model, VisionTransformer) and not model.training
    log = getattr(model, T.TRAIN_LOG_ATTR)
    assert log["val_accuracy"] >= 0.95 and log["steps_run"] == 40
    again = T.train_base_vit(Split(x, y), Split(xv, yv), arch, tcfg, mean=[0.5], std=[0.25])
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True)
    )  # seeded: the same run gives the same model


def test_finetune_member_trains_only_unfrozen_parts(tmp_path):
    adapter = get_adapter("vit")
    member = adapter.prune(tiny_vit(num_classes=2), [[0, 2], [1, 3], [0, 1]])
    before = _params(member)
    tcfg = T.TrainConfig(steps=6, batch_size=16, lr=1e-3, unfreeze="attention+head", progress=False)
    out = T.finetune_member(adapter, member, _image_data(), IMAGE_PREP, None, tcfg, T.Resume(tmp_path / "ck"), "m0")
    assert out is member and adapter.kept_heads(out) == [[0, 2], [1, 3], [0, 1]]
    for name, p in out.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == (T.param_part(name) in ("attention", "head")), name
        assert p.requires_grad  # flags restored after training


def test_finetune_member_resumes_to_the_same_weights(tmp_path):
    class Crashing(type(get_adapter("vit"))):
        calls = 0

        def forward(self, model, batch):
            Crashing.calls += 1
            if Crashing.calls == 8:
                raise RuntimeError("simulated crash")
            return super().forward(model, batch)

    adapter = get_adapter("vit")
    keep = [[0, 1, 3], [2, 3], [0, 1, 2]]
    base = tiny_vit(num_classes=2, proj_drop_rate=0.1)  # dropout: the RNG state must be restored too
    data = _image_data()
    tcfg = T.TrainConfig(steps=12, batch_size=16, lr=1e-3, hflip=True, checkpoint_every=3, progress=False)

    ref = T.finetune_member(
        adapter, adapter.prune(base, keep), data, IMAGE_PREP, None, tcfg, T.Resume(tmp_path / "a"), "ref"
    )
    crash_dir = tmp_path / "b"
    with pytest.raises(RuntimeError, match="simulated crash"):
        T.finetune_member(
            Crashing(), adapter.prune(base, keep), data, IMAGE_PREP, None, tcfg, T.Resume(crash_dir), "crash"
        )
    assert checkpoints.steps(crash_dir) == [6]  # saved after steps 3 and 6, only the last one kept
    resumed = T.finetune_member(
        adapter, adapter.prune(base, keep), data, IMAGE_PREP, None, tcfg, T.Resume(crash_dir), "resume"
    )
    assert getattr(resumed, T.TRAIN_LOG_ATTR)["steps_run"] == 6
    for (k, a), b in zip(ref.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    uninterrupted_but_other_lr = T.TrainConfig(**{**vars(tcfg), "lr": 5e-4})
    other = T.finetune_member(
        adapter,
        adapter.prune(base, keep),
        data,
        IMAGE_PREP,
        None,
        uninterrupted_but_other_lr,
        T.Resume(crash_dir),
        "other config",
    )
    assert getattr(other, T.TRAIN_LOG_ATTR)["steps_run"] == 12  # a checkpoint of another config is not resumed


def test_affine_crop_known_answers():
    """The whole image is the identity; the right half of a half-black, half-white image is white (but for the
    bilinear edge); the top-left quarter of a 4x4 ramp resized to 4x4 samples the ramp's first two columns."""
    x = torch.rand(2, 3, 8, 8)
    one, half = torch.ones(2), torch.full((2,), 0.5)
    torch.testing.assert_close(T.affine_crop(x, one, one, half, half), x, atol=1e-5, rtol=0)
    lr = torch.zeros(1, 1, 8, 8)
    lr[..., 4:] = 1.0
    right = T.affine_crop(lr, torch.ones(1), torch.full((1,), 0.5), torch.full((1,), 0.5), torch.full((1,), 0.75))
    # every output pixel samples the white half; the first column's bilinear sample sits a quarter pixel from the edge
    torch.testing.assert_close(right[..., 1:], torch.ones(1, 1, 8, 7), atol=1e-6, rtol=0)
    torch.testing.assert_close(right[..., 0], torch.full((1, 1, 8), 0.75), atol=1e-6, rtol=0)
    ramp = torch.arange(4.0).view(1, 1, 1, 4).expand(1, 1, 4, 4)
    quarter, centre = torch.full((1,), 0.5), torch.full((1,), 0.25)
    q = T.affine_crop(ramp, quarter, quarter, centre, centre)
    # output centres at 0.25, 0.75, 1.25, 1.75 px of a ramp whose pixel centres hold 0..3 (the first at the border)
    torch.testing.assert_close(q[0, 0, 0], torch.tensor([0.0, 0.25, 0.75, 1.25]), atol=1e-6, rtol=0)


def test_random_crops_are_seeded_and_stay_in_the_image():
    batch = {"pixel_values": torch.rand(16, 1, 16, 16)}
    a, b = T.crop(batch, 3, 0, 0.35), T.crop(batch, 3, 0, 0.35)
    torch.testing.assert_close(a["pixel_values"], b["pixel_values"], atol=0, rtol=0)  # a function of (seed, step)
    assert not torch.equal(a["pixel_values"], T.crop(batch, 4, 0, 0.35)["pixel_values"])
    assert a["pixel_values"].shape == batch["pixel_values"].shape
    assert float(a["pixel_values"].min()) >= 0 and float(a["pixel_values"].max()) <= 1  # inside: no padding values


def _finetune_image_member(adapter, base, data: Data, tcfg: T.TrainConfig, folder, label: str):
    """``base`` pruned to three 2-head members, fine-tuned on ``data`` with checkpoints in ``folder``."""
    member = adapter.prune(base, [[0, 1], [2, 3], [0, 3]])
    return T.finetune_member(adapter, member, data, IMAGE_PREP, None, tcfg, T.Resume(folder), label)


def test_dataloader_workers_give_the_same_weights(tmp_path):
    """``workers``: the batches come from DataLoader processes; each batch is a function of (seed, step), so two
    workers train exactly the weights the main process trains (flips included)."""
    adapter, data = get_adapter("vit"), _image_data()
    base = tiny_vit(num_classes=2)
    trained = []
    for workers in (0, 2):
        tcfg = T.TrainConfig(
            steps=6,
            batch_size=16,
            lr=1e-3,
            hflip=True,
            crop_scale=0.5,
            checkpoint_every=0,
            progress=False,
            workers=workers,
        )
        trained.append(_finetune_image_member(adapter, base, data, tcfg, tmp_path / str(workers), f"workers={workers}"))
    for (k, a), b in zip(trained[0].state_dict().items(), trained[1].state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_bf16_autocast_training_keeps_fp32_weights(tmp_path):
    """``precision: bf16``: the forward pass runs under bf16 autocast (other numbers than fp32's), the weights and
    the returned model stay fp32 and the loss still falls."""
    adapter, data = get_adapter("vit"), _image_data()
    base = tiny_vit(num_classes=2)
    out = {}
    for precision in ("fp32", "bf16"):
        tcfg = T.TrainConfig(steps=30, batch_size=16, lr=3e-3, checkpoint_every=0, progress=False, precision=precision)
        m = _finetune_image_member(adapter, base, data, tcfg, tmp_path / precision, precision)
        out[precision] = m
    assert all(p.dtype == torch.float32 for p in out["bf16"].parameters())
    a, b = out["fp32"].state_dict(), out["bf16"].state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)  # bf16 matmuls: not the fp32 run
    assert getattr(out["bf16"], T.TRAIN_LOG_ATTR)["val_accuracy"] > 0.8  # it learned the toy task


def test_finetune_text_member_and_bert(tmp_path, tok):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=2,
        attn_implementation="eager",
    )
    model = BertForSequenceClassification(cfg)
    good = [f"this is great and wonderful {w}" for w in ("today", "again", "really", "now", "indeed", "sir")]
    bad = [f"this is awful and terrible {w}" for w in ("today", "again", "really", "now", "indeed", "sir")]
    x, y = good + bad, np.array([1] * 6 + [0] * 6)
    tcfg = T.TrainConfig(steps=30, batch_size=8, lr=2e-3, weight_decay=0.0, label_smoothing=0.0, progress=False)
    model = T.finetune_bert(model, tok, Split(x, y), Split(x, y), tcfg, max_length=16)
    assert getattr(model, T.TRAIN_LOG_ATTR)["val_accuracy"] == 1.0

    adapter = get_adapter("bert")
    member = adapter.prune(model, [[0, 1], [2, 3]])
    before = _params(member)
    data = Data("text", ["neg", "pos"], Split(x, y), Split(x, y), Split(x, y), {}, {}, {})
    tcfg = T.TrainConfig(steps=3, batch_size=4, lr=1e-3, unfreeze="mlp", progress=False)
    T.finetune_member(
        adapter, member, data, {"type": "text", "max_length": 16}, tok, tcfg, T.Resume(tmp_path / "ck"), "m"
    )
    changed = {n for n, p in member.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(T.param_part(n) == "mlp" for n in changed)


def test_presets_are_valid_configs():
    for p in T.PRESETS.values():
        T.TrainConfig(**p["train"])
        T.TrainConfig(**p["finetune"])
        if "arch" in p:  # the presets that train a ViT from scratch (vit_pretrained fine-tunes a checkpoint)
            from timm.models.vision_transformer import VisionTransformer

            from offline.families.vit import check_supported

            with torch.device("meta"):
                check_supported(VisionTransformer(**p["arch"], num_classes=6))
            assert p["arch"]["num_heads"] == 6  # the image configs prune 2 heads per layer: 4 of 6 kept


def test_decoded_images_are_cached_and_exactly_the_servers(tmp_path):
    """A training loop decodes each image file once (the cache), and the tensors are what the server computes for
    the same bytes; a changed file is decoded anew."""
    import numpy as np
    from PIL import Image

    from service.core.preprocess import ImagePreprocessor

    paths = []
    for i in range(3):
        p = tmp_path / f"im{i}.png"
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (40 + 10 * i, 30, 3), dtype=np.uint8)).save(p)
        paths.append(str(p))
    spec = {
        "size": [16, 16],
        "mean": [0.5, 0.4, 0.3],
        "std": [0.2, 0.2, 0.2],
        "resize": "shorter_crop",
        "crop_pct": 0.875,
        "interpolation": "bicubic",
    }
    cache = T.DecodeCache()
    first = T.files_to_tensor(paths, spec, cache)
    again = T.files_to_tensor(paths[::-1], spec, cache)
    assert (cache.misses, cache.hits) == (3, 3)
    assert torch.equal(again, first.flip(0))
    server = ImagePreprocessor({"interpolation": "bilinear", "channels": 3, **spec}, 1 << 20)
    want = torch.stack([server(open(p, "rb").read()) for p in paths])
    assert torch.equal(first, want)  # bit for bit the server's tensors
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(paths[0])  # the file changes: decoded anew
    changed = T.files_to_tensor(paths[:1], spec, cache)
    assert cache.misses == 4 and not torch.equal(changed[0], first[0])
    small = T.DecodeCache(max_bytes=1)  # nothing fits: decoded per call, the same tensors
    assert torch.equal(T.files_to_tensor(paths[1:], spec, small), first[1:]) and small.bytes == 0


# ----------------------------------------------------------------------------- member recipes: partial, distillation
def test_last_blocks_trains_only_the_last_blocks_and_what_follows():
    vit = tiny_vit(depth=3)
    names = T.trainable_names(vit, "all", last_blocks=1)
    assert {T.block_of(n) for n in names} == {2, None}
    assert "head.weight" in names and "norm.weight" in names
    assert not any(n in names for n in ("cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.1.mlp.fc1.weight"))
    assert T.trainable_names(vit, "attention+mlp+norm+head", last_blocks=3) == T.trainable_names(
        vit, "attention+mlp+norm+head"
    )
    bert = tiny_bert(layers=3)
    names = T.trainable_names(bert, "attention+mlp+norm+head", last_blocks=2)
    assert {T.block_of(n) for n in names} == {1, 2, None}
    assert "bert.embeddings.LayerNorm.weight" not in names  # a norm, but before the blocks
    assert "classifier.weight" in names and "bert.pooler.dense.weight" in names
    with pytest.raises(ValueError, match="last_blocks"):
        T.TrainConfig(last_blocks=-1)


def test_partial_fine_tuning_leaves_the_early_blocks_unchanged():
    model = tiny_vit(depth=3, num_classes=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = _toy_images(64)
    tcfg = T.TrainConfig(steps=3, batch_size=16, lr=1e-2, label_smoothing=0.0, progress=False, last_blocks=1)
    T.fit(model, T.vit_forward, T.data_batcher(x, y, IMAGE_PREP, None, tcfg), len(y), tcfg)
    for n, p in model.named_parameters():
        moved = not torch.equal(p, before[n])
        assert moved == (T.block_of(n) == 2 or n.startswith(("head.", "norm."))), n


def test_distillation_loss_known_answers():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    assert T.distillation_loss(logits, logits, 2.0).item() == pytest.approx(0.0, abs=1e-7)
    teacher = torch.tensor([[0.0, 1.0, 0.0], [1.0, -1.0, 0.0]])
    for temp in (1.0, 3.0):
        p = F.softmax(teacher / temp, -1)
        q = F.softmax(logits / temp, -1)
        expected = (p * (p.log() - q.log())).sum(-1).mean() * temp**2  # KL(teacher || student), batch mean
        assert T.distillation_loss(logits, teacher, temp).item() == pytest.approx(expected.item(), rel=1e-5)


def test_a_student_distilled_alone_learns_its_teachers_answers():
    """With distill_weight 1 the labels do not count: a student trained on random labels matches its teacher."""
    teacher = tiny_vit(num_classes=2)
    torch.manual_seed(1)
    student = tiny_vit(num_classes=2)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x, _ = _toy_images(64)
    noise = np.random.default_rng(0).integers(0, 2, len(x))
    tcfg = T.TrainConfig(steps=40, batch_size=32, lr=3e-3, label_smoothing=0.0, progress=False, distill_weight=1.0)
    ((b, _),) = T.make_batches(x, noise, 64, "image", mean=[0.5], std=[0.25])
    with torch.no_grad():
        target = teacher(b["pixel_values"]).argmax(-1)
        agree_before = (student(b["pixel_values"]).argmax(-1) == target).float().mean().item()
    teacher_state = {n: p.clone() for n, p in teacher.state_dict().items()}
    T.fit(student, T.vit_forward, T.data_batcher(x, noise, IMAGE_PREP, None, tcfg), len(x), tcfg, teacher=teacher)
    with torch.no_grad():
        agree_after = (student(b["pixel_values"]).argmax(-1) == target).float().mean().item()
    assert agree_after >= 0.9 and agree_after > agree_before
    assert all(torch.equal(p, teacher_state[n]) for n, p in teacher.state_dict().items())  # the teacher is not trained


def test_checkpoints_made_before_distillation_still_resume():
    plain = T.fingerprint(T.TrainConfig(), 10, None)
    assert "distill" not in plain and "last_blocks" not in plain
    assert T.fingerprint(T.TrainConfig(distill_weight=0.5), 10, None) != plain
