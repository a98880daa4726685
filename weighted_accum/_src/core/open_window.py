"""The open window's read and reset kernels (``peek_mean`` is
``window.finish`` whose next window is thrown away, ``discard`` is
``window.next_window``); the public functions are in
``across_steps.peek``."""

from __future__ import annotations

import functools
from typing import Any

import jax

from weighted_accum._src.core import window
from weighted_accum._src.core.base import AccumState


@functools.partial(jax.jit, static_argnums=1)
def _peek_kernel(state: AccumState, axes: tuple[str, ...]):
  out, _ = window.finish(state, mean=True, axes=axes, what="peek_mean")
  return out


@jax.jit
def _discard_kernel(state: AccumState, next_loss_scale: Any) -> AccumState:
  return window.next_window(state, next_loss_scale)
