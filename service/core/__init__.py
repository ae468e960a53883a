"""The library the builder and the server share: fused models, statistics, the artifact contract, preprocessing.

* models: :mod:`.fused` (ViT, BERT), :mod:`.fused_clip` (the dual encoder) and :mod:`.registry` (every
  architecture by name, built or loaded from an artifact), run by :mod:`.backends` (eager, TorchScript,
  AOTInductor, ONNX Runtime);
* statistics, pure functions over member logits ``(B, M, C)``: :mod:`.uncertainty`, :mod:`.ood`,
  :mod:`.conformal`, :mod:`.drift`, :mod:`.guarantees`;
* the artifact contract: :mod:`.manifest` (the manifest's typed model) and :mod:`.artifact` (its one writer and
  reader, the files' hashes);
* inputs: :mod:`.preprocess` (decoding and preprocessing, the same for a build and a request), raising the
  domain errors of :mod:`.errors`; facts about the machine: :mod:`.hardware`; the JSON log line: :mod:`.jsonlog`.

``offline`` imports only this package; it imports neither the server nor ``offline`` (``pyproject.toml``,
``[tool.importlinter]``).
"""
