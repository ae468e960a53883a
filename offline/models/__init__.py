"""Pretrained models in, fused models out: loading every base model a build starts from
(:mod:`.loaders`, its keys checked) and exporting the fused model (:mod:`.export`: TorchScript, ONNX, AOTInductor,
each checked against eager).

May import: ``service.core`` and :mod:`offline.config`; never training, a build step or a pipeline.
"""
