"""The open window's read and reset kernels (``peek_mean`` is
``window.finish`` whose next window is thrown away, ``discard`` is
``window.next_window``); the public functions are in
``across_steps.peek``."""

from __future__ import annotations

from typing import Any

import jax

from weighted_accum._src.core import window
from weighted_accum._src.core.base import AccumState


@jax.jit
def _discard_kernel(state: AccumState, next_loss_scale: Any) -> AccumState:
  return window.next_window(state, next_loss_scale)
