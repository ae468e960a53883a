"""The stages of a build, each over one :class:`~offline.stages.context.BuildContext`.

A build is a chain of stages (``offline.pipelines.classifier_build`` for classifiers,
``offline.pipelines.zeroshot_build`` for zero-shot
models). The pipeline makes the context once, from the config, the data and its family's base model; each stage
then takes it and returns a typed result that the later ones take::

    data -> base model -> head scores -> members -> fine-tune -> fuse -> calibrate -> evaluate -> guarantees
      -> exports -> artifact

One module per stage:

* :mod:`.context`: the context, the timer whose laps go into the manifest, where the work computes;
* :mod:`.datasets`: the data, its scoring and evaluation batches, a model's outputs over them;
* :mod:`.ensemble`: head scoring, the members sampled from its ranking, their fusion;
* :mod:`.finetune`: each member fine-tuned with its own recipe, resumable;
* :mod:`.calibrate`: the served temperature, OOD score and threshold;
* :mod:`.evaluation`: every method on every set, the report's rows;
* :mod:`.shift_eval`: every method on shifted copies of the ID test inputs;
* :mod:`.certify`: the served model's guarantees and the report's section of them;
* :mod:`.package`: weights, checked exports, the report and the manifest.

The mathematics the stages run (head scoring, member sampling, temperature and thresholds, OOD statistics,
guarantees) lives in :mod:`offline.method`, exports in :mod:`offline.models`, training in :mod:`offline.train` and
the report in :mod:`offline.report`; the base models come from the pipelines (:mod:`offline.pipelines`).

May import: the rooms under it (training, the report, data, models, the mathematics, the config, the families);
never a pipeline or an entry point. The names below are the ones the benchmarks and tests import from
``offline.stages``.
"""

from __future__ import annotations

from offline import data as data_mod  # the data sets load_data reads (tests replace a setting's loader through it)
from offline.stages.calibrate import layer_candidate_name
from offline.stages.context import BuildContext, Timer
from offline.stages.datasets import (
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
from offline.stages.ensemble import Members, ScoringBatches, build_members, scoring_batches
from offline.stages.finetune import finetune_members

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
