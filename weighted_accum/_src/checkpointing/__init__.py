"""Orbax checkpointing of windows: ``checkpoint`` (``AccumSave``,
``AccumRestore`` and their handler) and ``saved_form`` (the saved form of a
tree of windows, ``abstract_state`` and the checks of restored values)."""
