"""Training for the builder: the base ViT trained here, MiniLM fine-tuning, and pruned-member fine-tuning.

One loop (:func:`fit`) serves all of them, with the paper's recipe: AdamW (or SGD), linear warm-up then cosine
decay, label smoothing, gradient clipping. Batches are drawn without replacement from seeded per-epoch
permutations that depend only on ``(seed, step)``, so a run is a deterministic function of its config, and a
member fine-tuning interrupted at any point resumes from its last checkpoint to the same final weights as an
uninterrupted run.

One module per concern:

* :mod:`.presets`: :class:`TrainConfig` and the named :data:`PRESETS`;
* :mod:`.parts`: which parameters train (``unfreeze``);
* :mod:`.schedule`: the optimizer and the learning-rate schedule;
* :mod:`.batches`, :mod:`.decode`, :mod:`.augment`: inputs as model batches (image files through the server's
  preprocessing, decoded once), and the training-time flips and crops;
* :mod:`.loop`: :func:`fit`, its batch order and :func:`accuracy` (checkpoint files: :mod:`offline.train.checkpoints`);
* :mod:`.runs`: the runs a build makes (:func:`train_base_vit`, :func:`finetune_bert`, :func:`finetune_member`).

The pretrained models these start from are loaded by :mod:`offline.models.loaders` (:func:`load_minilm_classifier` and
:func:`minilm_path` are importable from here too).

Also here: :mod:`.checkpoints` (a resumable run's files), :mod:`.pretrain` (the image backbone,
``python -m offline.train.pretrain``) and :mod:`.lit` (the locked-text zero-shot model).

May import: data, models, the config, the families, ``compute`` and ``progress``; never a build step or a pipeline.
"""

from __future__ import annotations

from offline.models.loaders import load_minilm_classifier, minilm_path
from offline.train.augment import CROP_RATIO, affine_crop, crop, flip
from offline.train.batches import (
    Batch,
    GetBatch,
    Labelled,
    data_batcher,
    image_kw,
    images_to_tensor,
    make_batches,
    tokenize,
    val_batches,
)
from offline.train.checkpoints import completed_steps
from offline.train.decode import DECODED, IMAGE_FILE_LIMIT, DecodeCache, files_to_tensor
from offline.train.loop import (
    Forward,
    Resume,
    accuracy,
    batch_indices,
    distillation_loss,
    fingerprint,
    fit,
    recorded,
    step_batches,
)
from offline.train.parts import PARTS, block_of, param_part, trainable_names, unfreeze_parts
from offline.train.presets import GRAY_MEAN, GRAY_STD, PRESETS, TrainConfig
from offline.train.runs import (
    TRAIN_LOG_ATTR,
    finetune_bert,
    finetune_member,
    hf_forward,
    train_base_vit,
    train_classifier_on_arrays,
    vit_forward,
)
from offline.train.schedule import lr_factor, make_optimizer, make_scheduler

__all__ = [
    "CROP_RATIO",
    "DECODED",
    "GRAY_MEAN",
    "GRAY_STD",
    "IMAGE_FILE_LIMIT",
    "PARTS",
    "block_of",
    "recorded",
    "distillation_loss",
    "PRESETS",
    "TRAIN_LOG_ATTR",
    "Batch",
    "DecodeCache",
    "Forward",
    "GetBatch",
    "Labelled",
    "Resume",
    "TrainConfig",
    "accuracy",
    "affine_crop",
    "batch_indices",
    "completed_steps",
    "crop",
    "data_batcher",
    "files_to_tensor",
    "fingerprint",
    "finetune_bert",
    "finetune_member",
    "fit",
    "flip",
    "hf_forward",
    "image_kw",
    "images_to_tensor",
    "load_minilm_classifier",
    "lr_factor",
    "make_batches",
    "make_optimizer",
    "make_scheduler",
    "minilm_path",
    "param_part",
    "step_batches",
    "tokenize",
    "train_base_vit",
    "train_classifier_on_arrays",
    "trainable_names",
    "unfreeze_parts",
    "val_batches",
    "vit_forward",
]
