"""tr_onnx's fuzzer (issue 35): four generators of cases, each case run in a process of its own
under a memory limit and a timeout, and classified as a clean error, a success (equal to the
references where there are references), or a bug.

- ``generators.py``: what a case is (files, an action) and the four generators: structure-aware
  and byte-level mutations of the model zoo (the mutators of ``tests/fuzz_models.py``, plus
  external-data paths that point out of the model's folder), random small graphs of registered
  ONNX ops compared with ``onnx.reference`` and onnxruntime, and bad training data files run
  through ``tr-onnx train``.
- ``runner.py``: the worker (imports once, forks a child per case), the classification, the
  campaign over worker processes and its report; ``known_bugs.py``: the bugs the fuzzer still
  finds, by signature, each naming its issue-35 item.

``tests/test_fuzz.py`` runs a bounded campaign in CI; ``scripts/fuzz.py --minutes N`` a long one.
"""
