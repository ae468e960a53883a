"""The HTTP layer: the routes of both protocols over one inference path, and everything about bodies.

* routes: :mod:`.v1` (``/predict``, ``/zero-shot``, health, models, the guarantees' and feedback endpoints) and
  :mod:`.oip` (the Open Inference Protocol, ``/v2``, its tensors coded by :mod:`.oip_codec`);
* one inference path both share: :mod:`.dataplane` (limits -> model -> inputs -> the runtime's outcome);
* bodies: :mod:`.schemas` (request and response models), :mod:`.requests` (parsing JSON and multipart),
  :mod:`.answers` (a runtime's outcome -> the ``/predict`` answer);
* :mod:`.errors` (the domain errors' one mapping to the contract's error body) and :mod:`.middleware`.

A runtime (:mod:`service.runtime`) returns an outcome and knows nothing of HTTP; each protocol shapes its own body.
"""
