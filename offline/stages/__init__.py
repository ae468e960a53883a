"""The stages of a build, each over one :class:`~offline.stages.context.BuildContext`.

A build is a chain of stages (``offline.pipeline`` for classifiers, ``offline.pipeline_clip`` for zero-shot
models). The pipeline makes the context once, from the config, the data and its family's base model; each stage
then takes it and returns a typed result that the later ones take::

    data -> base model -> head scores -> members -> fine-tune -> fuse -> calibrate -> evaluate -> guarantees
      -> exports -> artifact

One module per stage:

* :mod:`.context`: the context, the timer whose laps go into the manifest, where the work computes;
* :mod:`.data`: the data, its scoring and evaluation batches, a model's outputs over them;
* :mod:`.members`: head scoring, the members sampled from its ranking, their fusion;
* :mod:`.finetune`: each member fine-tuned with its own recipe, resumable;
* :mod:`.calibration`: the served temperature, OOD score and threshold;
* :mod:`.evaluation`: every method on every set, the report's rows;
* :mod:`.guarantees`: the served model's guarantees and the report's section of them;
* :mod:`.artifact`: weights, checked exports, the report and the manifest.

The library code the stages run (head scoring, member sampling, temperature and thresholds, OOD statistics,
guarantees, exports, the report) lives beside this package (``offline/scoring.py``, ``offline/members.py``, ...),
and the base models in their families' pipelines. The names below are the ones the benchmarks and tests import
from ``offline.stages``.
"""

from __future__ import annotations

from offline import data as data_mod  # the data sets load_data reads (tests replace a setting's loader through it)
from offline.stages.calibration import layer_candidate_name
from offline.stages.context import BuildContext, Timer
from offline.stages.data import (
    EVAL_MAX_PIXELS,
    FASHION_MEAN,
    FASHION_STD,
    batches_of,
    circuit_batches,
    collect,
    collect_logits,
    concat,
    eval_batches,
    load_data,
    sample_indices,
    take,
    with_features,
)
from offline.stages.finetune import finetune_members
from offline.stages.members import Members, ScoringBatches, build_members, scoring_batches

__all__ = [
    "EVAL_MAX_PIXELS",
    "FASHION_MEAN",
    "FASHION_STD",
    "BuildContext",
    "Members",
    "ScoringBatches",
    "Timer",
    "batches_of",
    "build_members",
    "circuit_batches",
    "collect",
    "collect_logits",
    "concat",
    "data_mod",
    "eval_batches",
    "finetune_members",
    "layer_candidate_name",
    "load_data",
    "sample_indices",
    "scoring_batches",
    "take",
    "with_features",
]
