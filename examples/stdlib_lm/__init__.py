"""A real workload: a byte-level LM on the standard library's own sources.

Modules: :mod:`.data` (the corpus, rows, batches, microbatches),
:mod:`.model` (the Flax NNX transformer and its losses), :mod:`.train` (the
full-batch, ``optax.MultiSteps``, ``WeightedMultiSteps`` and in-step runs),
:mod:`.measure` (window gradients against the full batch, speed, compiled
memory), :mod:`.experiment` (everything, as one JSON-ready dict) and
:mod:`.report` (Markdown and a figure). Run ``python examples/stdlib_lm
--full`` (see ``__main__``); ``notebooks/06_real_text.ipynb`` and
``docs/real_text.md`` show the results.
"""
