"""The builder's mathematics: what a build computes, apart from how a build is run.

* :mod:`.head_scores`: head importance (first-order Taylor, greedy circuits, random);
* :mod:`.members`: the members' head sets, sampled per pruning seed, and the structural pruning;
* :mod:`.fusion`: the members fused into one ``service.core`` model;
* :mod:`.calibration`: the temperature and the OOD threshold;
* :mod:`.ood_fit`: the OOD statistics, the served score's choice and every score's detection quality;
* :mod:`.guarantee_fits`: prediction sets, OOD p-values, risk rules and the drift alarm's reference;
* :mod:`.ensemble_metrics`: an ensemble's classification, calibration and OOD metrics (numpy);
* :mod:`.corruptions`: the shifted copies of ID inputs that the report and the stream benchmark measure.

May import: ``service.core``, :mod:`offline.families` and :mod:`service.core.progress`; never a build step, a pipeline,
training or the report.
"""
