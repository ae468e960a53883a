"""The builder: one pretrained transformer and a data set in, one Hydra artifact out.

The rooms, top to bottom; each imports only the rooms below it (the import contracts in ``pyproject.toml`` hold it):

* ``default``, ``build``: the entry points (``python -m offline.default``, ``python offline/build.py``);
* ``pipelines/``: a whole build per kind of model (classifier, zero-shot), the base models they start from and the
  efficient-ensemble baselines;
* ``stages/``: the steps of a build over one build context (data, members, fine-tuning, calibration, evaluation,
  guarantees, the artifact);
* ``train/``, ``report/``: training runs (the loop, presets, checkpoints, pretraining, LiT); the build report;
* ``data/``, ``models/``, ``method/``: data sets and test sets; loading pretrained models and exporting fused ones;
  the mathematics (head scores, members, fusion, calibration, guarantees, OOD fits, shift corruptions);
* ``config``: the build configuration and its validation;
* ``families/``, ``compute``: the model families' adapters, and where and in which precision a build computes
  (progress on long work is :mod:`service.core.progress`, shared with ``hydra-predict``).

``service.core`` sits under all of them; nothing here imports the rest of ``service``.
"""
