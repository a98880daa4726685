"""Orbax checkpointing of windows: ``checkpoint`` (``AccumSave``,
``AccumRestore``, their handler and ``abstract_state``)."""
