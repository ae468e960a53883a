"""Whole builds, one per kind of model, each a chain of :mod:`offline.stages`:

* :mod:`.classifier_build`: families ``vit`` and ``bert``;
* :mod:`.zeroshot_build`: family ``clip``;
* :mod:`.bases`: the classifier families' base models (trained here or fine-tuned);
* :mod:`.baselines`: the efficient-ensemble baselines a build reports beside Hydra.

May import every room below it (stages, training, data, models, the mathematics, the config, the families); only
the entry points (:mod:`offline.build`, :mod:`offline.default`) import it.
"""
