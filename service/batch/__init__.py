"""Batch scoring (``hydra-predict``, ``python -m service.batch``): a folder, CSV, JSONL or Parquet file through an
artifact, every row with the fields of ``/predict``, in-process or on Ray Data; docs/batch.md.

* :mod:`.inputs`: the inputs, streamed in order in chunks;
* :mod:`.scorer`: one chunk through the server's own runtime, guarantees and answer fields, without HTTP;
* :mod:`.part_files`: the output in numbered parts written whole, so that a killed run resumes;
* :mod:`.batch_summary`: the batch's label-free accuracy, its one shift test, the inputs to label first;
* :mod:`.run_spec`: what a run's rows come from (options, ``run.json``), shared by both engines;
* :mod:`.command`: the command; :mod:`.ray_engine`: the same on Ray Data (``--engine ray``, the ``batch`` extra).

A room of the server's top floor, beside :mod:`service.entrypoints`: it may import every layer of the server;
nothing of the server imports it.
"""
