"""``hydra-predict --engine ray``: the same rows on Ray Data, from a laptop to a cluster (``--address``; KubeRay's
``RayJob``: deploy/batch/).

The parts not yet written are the work: Ray Data runs :class:`PartScorer` actors over them (``map_batches`` with an
actor class: the artifact loaded once per actor, ``--actors`` of them, one GPU each when the settings ask for CUDA).
Each actor reads its part's inputs, scores them as the in-process run does (:class:`~service.batch.scorer.
BatchScorer`) and writes the part whole into ``--out`` (a folder every node sees, as the server's artifact volume
is), so that a killed job started again skips the parts that are done. The driver only counts the rows as they come
back and, at the end, writes the summary as the in-process run does.

Needs the ``batch`` extra (``pip install 'hydra-serve[batch]'``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from service.batch.inputs import BatchInputError, open_source
from service.batch.part_files import Parts
from service.batch.run_spec import options_of, run_record
from service.batch.scorer import BatchOptions, BatchScorer
from service.core.artifact import Manifest, artifact_version, load_manifest
from service.core.guarantees import load_guarantees
from service.core.progress import bar
from service.settings import Settings
from service.store import open_store

__all__ = ["PartScorer", "run_ray"]


class PartScorer:
    """A Ray actor: the artifact loaded once; each call scores whole parts and writes them."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.scorer = BatchScorer(spec["artifact"], Settings(), BatchOptions(**spec["options"]))
        args = spec["source"]
        self.source = open_source(args["path"], args["column"], args["id_column"], self.scorer.modality)
        self.parts = Parts(spec["out"], spec["format"], spec["part_size"], spec["run"])
        if spec["run"]["record"]:  # each actor records its answers in the store every node reaches (HYDRA_STORE_URL)
            store = open_store(Settings())
            if store is None:
                raise BatchInputError("--record needs the prediction store: HYDRA_STORE is off")
            self.scorer.record_into(store, self.parts.run_id)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[int]]:
        size, done = self.spec["part_size"], []
        for k in [int(k) for k in batch["part"]]:
            if self.parts.path(k).exists():  # a part another attempt already wrote
                done.append(0)
                continue
            chunks = self.source.chunks(self.spec["batch_size"], skip=k * size, stop=(k + 1) * size)
            scored = self.scorer.rows(chunks, threads=self.spec["threads"], first=k * size)
            rows = [r for chunk in scored for r in chunk]
            if self.scorer.rt.monitor is not None:
                self.scorer.rt.monitor.store.flush()  # recorded before the part says it is done
            self.parts.write(k, rows)
            done.append(len(rows))
        return {"part": [int(k) for k in batch["part"]], "rows": done}


def run_ray(args: argparse.Namespace, settings: Settings) -> tuple[Parts, Manifest, Any]:
    """Score every part not yet written on Ray Data; ``(parts, the artifact's manifest, its guarantees)``."""
    import ray  # the batch extra: imported when a Ray run starts

    manifest = load_manifest(args.artifact)
    if manifest.task != "classification":
        raise BatchInputError(
            f"{args.artifact}: hydra-predict scores classifier artifacts; this one is {manifest.task}"
        )
    modality = "text" if manifest.preprocessing.type == "text" else "image"
    source = open_source(args.input, args.column, args.id_column, modality)
    options = options_of(args)
    described = {"model": manifest.name, "version": artifact_version(manifest), "options": vars(options)}
    record = run_record(args, described)
    parts = Parts(args.out, args.format, args.part_size, record)
    total, done = source.count(), parts.done()
    todo = [k for k in range(-(-total // args.part_size)) if not parts.path(k).exists()]
    spec = {
        "artifact": str(args.artifact.resolve()),
        "options": vars(options),
        "source": {"path": str(args.input.resolve()), "column": args.column, "id_column": args.id_column},
        "out": str(Path(args.out).resolve()),
        "format": args.format,
        "part_size": args.part_size,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "run": record,
    }
    env = {k: v for k, v in os.environ.items() if k.startswith(("HYDRA_", "OMP_", "HF_", "TRANSFORMERS_"))}
    started = not ray.is_initialized()  # a caller's own Ray (a notebook, a test) is used as it is, and left running
    if started:
        ray.init(address=args.address, runtime_env={"env_vars": env}, log_to_driver=False, include_dashboard=False)
    try:
        gpu = 1 if settings.device.startswith("cuda") else 0
        start = min(done * args.part_size, total)
        progress, t0 = bar(desc="batch", total=total, initial=start), time.monotonic()
        if todo:
            ds = ray.data.from_items([{"part": k} for k in todo], override_num_blocks=len(todo))
            out = ds.map_batches(
                PartScorer,
                fn_constructor_args=(spec,),
                batch_size=1,
                compute=ray.data.ActorPoolStrategy(size=args.actors),
                num_gpus=gpu,
                num_cpus=0 if gpu else max(1, settings.threads or 1),
            )
            for row in out.iter_rows():
                progress.update(int(row["rows"]))
        progress.close()
        parts.rate = (total - start, time.monotonic() - t0)  # Ray's start and the actors' model loads included
    finally:
        if started:
            ray.shutdown()
    return parts, manifest, load_guarantees(args.artifact, manifest)
