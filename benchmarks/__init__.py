"""Benchmarks of weighted_accum, one module per family of figures.

Run ``python -m benchmarks [family ...] [--smoke] [--full] [--runs N]``
from the repository root; see ``benchmarks/README.md``. The harness
(``harness.py``: the timing method, the shared trees and steps) and the
results writer (``report.py``) serve every family: ``accumulate``,
``train_step``, ``close``, ``compile``, ``in_step``, ``end_to_end``,
``memory``.
"""
