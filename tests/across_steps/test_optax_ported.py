"""optax's own ``MultiSteps`` tests, ported to ``wa.WeightedMultiSteps``.

Ported from optax 0.2.8 (Apache-2.0): the ``MultiSteps`` cases of
``optax/transforms/_accumulation_test.py`` and the ``test_gradient_accumulation``
cases of ``optax/_src/alias_test.py``, ``optax/_src/factorized_test.py`` and
``optax/contrib/_common_test.py``, with ``MultiSteps`` renamed to
``wa.WeightedMultiSteps`` and ``weight=1`` added to every update; their
assertions are unchanged. Where the library differs by design, the test says
so and checks the documented behaviour instead.

Then the properties the port alone does not show, for every optimizer of
those parameter lists: with weight 1 the updates equal ``optax.MultiSteps``'
(rtol 1e-6) over several windows, and with unequal weights the params equal
a full-batch reference (one ``jax.grad`` over the whole window, the inner
optimizer applied directly). Each compiled step is reused across the
hypothesis-free cases so the module stays fast.
"""

from __future__ import annotations

import functools
import warnings

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import contrib
import pytest

import weighted_accum as wa

# -- parameter lists, as in optax's test modules ------------------------------

# optax/transforms/_accumulation_test.py
OPTIMIZERS_TO_TEST = [
  {"opt_name": "adam", "opt_kwargs": {"learning_rate": 0.1}},
  {
    "opt_name": "adam",
    "opt_kwargs": {"learning_rate": 0.1, "mu_dtype": jnp.float32},
  },
]

# optax/_src/alias_test.py
ALIAS_OPTIMIZERS = (
  {"opt_name": "adabelief", "opt_kwargs": {"learning_rate": 1e-2}},
  {"opt_name": "adadelta", "opt_kwargs": {"learning_rate": 0.1}},
  {"opt_name": "adadelta", "opt_kwargs": {}},
  {"opt_name": "adafactor", "opt_kwargs": {"learning_rate": 5e-3}},
  {"opt_name": "adafactor", "opt_kwargs": {}},
  {"opt_name": "adagrad", "opt_kwargs": {"learning_rate": 1.0}},
  {"opt_name": "adam", "opt_kwargs": {"learning_rate": 1e-1}},
  {"opt_name": "adamax", "opt_kwargs": {"learning_rate": 1e-1}},
  {"opt_name": "adamaxw", "opt_kwargs": {"learning_rate": 1e-1}},
  {"opt_name": "adamw", "opt_kwargs": {"learning_rate": 1e-1}},
  {"opt_name": "adan", "opt_kwargs": {"learning_rate": 1e-1}},
  {"opt_name": "amsgrad", "opt_kwargs": {"learning_rate": 1e-1}},
  {"opt_name": "fromage", "opt_kwargs": {"learning_rate": 5e-3}},
  {"opt_name": "lamb", "opt_kwargs": {"learning_rate": 1e-3}},
  {"opt_name": "lars", "opt_kwargs": {"learning_rate": 1.0}},
  {
    "opt_name": "lion",
    "opt_kwargs": {"learning_rate": 1e-2, "weight_decay": 1e-4},
  },
  {"opt_name": "nadam", "opt_kwargs": {"learning_rate": 1e-2}},
  {"opt_name": "nadamw", "opt_kwargs": {"learning_rate": 1e-2}},
  {
    "opt_name": "noisy_sgd",
    "opt_kwargs": {"learning_rate": 1e-3, "eta": 1e-4, "key": 0},
  },
  {"opt_name": "novograd", "opt_kwargs": {"learning_rate": 1e-3}},
  {"opt_name": "optimistic_adam", "opt_kwargs": {"learning_rate": 2e-3}},
  {"opt_name": "optimistic_adam_v2", "opt_kwargs": {"learning_rate": 2e-3}},
  {
    "opt_name": "optimistic_gradient_descent",
    "opt_kwargs": {"learning_rate": 2e-3, "alpha": 0.7, "beta": 0.1},
  },
  {"opt_name": "polyak_sgd", "opt_kwargs": {"max_learning_rate": 1.0}},
  {"opt_name": "radam", "opt_kwargs": {"learning_rate": 5e-3}},
  {"opt_name": "rmsprop", "opt_kwargs": {"learning_rate": 5e-3}},
  {
    "opt_name": "rmsprop",
    "opt_kwargs": {"learning_rate": 5e-3, "momentum": 0.9},
  },
  {"opt_name": "rprop", "opt_kwargs": {"learning_rate": 1e-1}},
  {"opt_name": "sgd", "opt_kwargs": {"learning_rate": 1e-3, "momentum": 0.9}},
  {"opt_name": "sign_sgd", "opt_kwargs": {"learning_rate": 1e-1}},
  {"opt_name": "signum", "opt_kwargs": {"learning_rate": 1e-2}},
  {"opt_name": "sm3", "opt_kwargs": {"learning_rate": 1.0}},
  {"opt_name": "yogi", "opt_kwargs": {"learning_rate": 1e-1}},
)

# optax/contrib/_common_test.py (_MAIN_OPTIMIZERS_UNDER_TEST)
CONTRIB_OPTIMIZERS = (
  {"opt_name": "acprop", "opt_kwargs": {"learning_rate": 1e-3}},
  {"opt_name": "ademamix", "opt_kwargs": {"learning_rate": 1e-3}},
  {"opt_name": "simplified_ademamix", "opt_kwargs": {"learning_rate": 1e-3}},
  {"opt_name": "adopt", "opt_kwargs": {"learning_rate": 1e-2}},
  {"opt_name": "cocob", "opt_kwargs": {}},
  {"opt_name": "cocob", "opt_kwargs": {"weight_decay": 1e-2}},
  {"opt_name": "dadapt_adamw", "opt_kwargs": {"learning_rate": 1e-1}},
  {"opt_name": "dog", "opt_kwargs": {"learning_rate": 1.0}},
  {"opt_name": "dowg", "opt_kwargs": {"learning_rate": 1.0}},
  {"opt_name": "madgrad", "opt_kwargs": {"learning_rate": 1e-2}},
  {"opt_name": "momo", "opt_kwargs": {"learning_rate": 1e-1}},
  {"opt_name": "momo_adam", "opt_kwargs": {"learning_rate": 1e-1}},
  {"opt_name": "muon", "opt_kwargs": {"learning_rate": 1e-2}},
  {"opt_name": "prodigy", "opt_kwargs": {"learning_rate": 1e-1}},
  {
    "opt_name": "schedule_free_sgd",
    "opt_kwargs": {"learning_rate": 1e-2, "warmup_steps": 5000},
  },
  {
    "opt_name": "schedule_free_adamw",
    "opt_kwargs": {"learning_rate": 1e-2, "warmup_steps": 5000},
  },
  {"opt_name": "sophia", "opt_kwargs": {"learning_rate": 1e-2}},
  {"opt_name": "galore", "opt_kwargs": {"learning_rate": 1e-2, "rank": 8}},
  {
    "opt_name": "sgd",
    "opt_kwargs": {"learning_rate": 1e-1},
    "wrapper_name": "mechanize",
    "wrapper_kwargs": {"weight_decay": 0.0},
  },
  {
    "opt_name": "sgd",
    "opt_kwargs": {"learning_rate": 1e-2},
    "wrapper_name": "schedule_free",
    "wrapper_kwargs": {"learning_rate": 1e-2},
  },
  {
    "opt_name": "sgd",
    "opt_kwargs": {"learning_rate": 1e-3},
    "wrapper_name": "reduce_on_plateau",
    "wrapper_kwargs": {},
  },
)

DTYPES = ("bfloat16", "float32")


def _id(case):
  name = case["opt_name"]
  if case.get("wrapper_name"):
    name = f"{case['wrapper_name']}({name})"
  return name + (
    ""
    if not case["opt_kwargs"]
    else "-" + "-".join(f"{k}={v}" for k, v in case["opt_kwargs"].items())
  )


def _alias(opt_name, opt_kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # optimistic_adam
    return getattr(optax, opt_name)(**opt_kwargs)


def _contrib(opt_name, opt_kwargs, wrapper_name=None, wrapper_kwargs=None):
  factory = (
    getattr(contrib, opt_name)
    if hasattr(contrib, opt_name)
    else getattr(optax, opt_name)
  )
  opt = factory(**opt_kwargs)
  if wrapper_name == "reduce_on_plateau":
    opt = optax.chain(opt, contrib.reduce_on_plateau(**wrapper_kwargs))
  elif wrapper_name is not None:
    opt = getattr(contrib, wrapper_name)(opt, **wrapper_kwargs)
  return opt


def _assert_trees_all_equal(actual, desired):
  """optax's ``test_utils.assert_trees_all_equal``."""
  flat_a, def_a = jax.tree.flatten(actual)
  flat_d, def_d = jax.tree.flatten(desired)
  assert def_a == def_d, f"different structures:\n{def_a}\n{def_d}"
  for x, y in zip(flat_a, flat_d):
    np.testing.assert_array_equal(x, y)


# -- optax/transforms/_accumulation_test.py -------------------------------------


class Loss(flax.linen.Module):
  @flax.linen.compact
  def __call__(self, x, dtype=jnp.float32, param_dtype=jnp.float32):
    return jnp.sum(
      flax.linen.Dense(10, dtype=dtype, param_dtype=param_dtype)(x) ** 2
    )


def test_multi_steps():
  batch_size, x_size, k_steps = 32, 7, 4
  data = jnp.ones([batch_size, x_size])
  loss = Loss()
  params = loss.init({"params": jax.random.key(0)}, data)["params"]

  def loss_apply(params, data):
    return loss.apply({"params": params}, data)

  ms_opt = wa.WeightedMultiSteps(
    optax.chain(
      optax.scale_by_adam(), optax.add_decayed_weights(1e-2), optax.scale(-1e-4)
    ),
    k_steps,
    mode="mean",
  )
  opt_init, opt_update = ms_opt.gradient_transformation()

  @jax.jit
  def train_step(data, opt_state, params):
    grad = jax.grad(loss_apply)(params, data)
    return opt_update(grad, opt_state, params, weight=1)

  opt_state = opt_init(params)
  prev_loss = loss_apply(params, data)
  for idx in range(5 * k_steps):
    updates, opt_state = train_step(data, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    new_loss = loss_apply(new_params, data)
    if idx % k_steps < k_steps - 1:
      jax.tree.map(np.testing.assert_array_equal, new_params, params)
      np.testing.assert_equal(new_loss, prev_loss)
      assert not ms_opt.has_updated(opt_state)
    else:
      np.testing.assert_array_less(new_loss, prev_loss)
      prev_loss = new_loss
      assert ms_opt.has_updated(opt_state)
    params = new_params


def test_multi_steps_every_k_schedule():
  ms_opt = wa.WeightedMultiSteps(
    optax.sgd(1e-4),
    lambda grad_step: jnp.where(grad_step < 2, 1, 3),
    mode="mean",
  )
  opt_init, opt_update = ms_opt.gradient_transformation()
  opt_update = jax.jit(functools.partial(opt_update, weight=1))  # jit once
  params = {"a": jnp.zeros([])}
  opt_state = opt_init(params)
  grad = {"a": jnp.zeros([])}
  assert not ms_opt.has_updated(opt_state)
  for _ in range(2):
    _, opt_state = opt_update(grad, opt_state, params)
    assert ms_opt.has_updated(opt_state)
  for _ in range(5):
    for _ in range(2):
      _, opt_state = opt_update(grad, opt_state, params)
      assert not ms_opt.has_updated(opt_state)
    _, opt_state = opt_update(grad, opt_state, params)
    assert ms_opt.has_updated(opt_state)


def test_multi_steps_scan_dtype_stability():
  ms_opt = wa.WeightedMultiSteps(
    optax.sgd(1e-4), 2, accumulator_dtype=jnp.float32, mode="mean"
  )
  opt_init, opt_update = ms_opt.gradient_transformation()
  params = {"a": jnp.zeros([], dtype=jnp.bfloat16)}

  def train_step(state, _):
    grad = {"a": jnp.ones([], dtype=jnp.bfloat16)}
    updates, opt_state = opt_update(grad, state, params, weight=1)
    return opt_state, updates

  opt_state = opt_init(params)
  final_state, _ = jax.lax.scan(train_step, opt_state, jnp.arange(4))
  assert final_state.acc_grads["a"].dtype == jnp.float32


def test_multi_steps_zero_nans():
  ms_opt = wa.WeightedMultiSteps(
    optax.chain(optax.zero_nans(), optax.sgd(1e-4)),
    every_k_schedule=2,
    mode="mean",
  )
  opt_init, opt_update = ms_opt.gradient_transformation()
  params = {"a": jnp.zeros([])}
  opt_state = opt_init(params)
  grad = {"a": jnp.zeros([])}
  opt_update(grad, opt_state, params, weight=1)


def test_multi_steps_computes_mean():
  k_steps = 4
  ms_opt = wa.WeightedMultiSteps(
    optax.scale(1.0), k_steps, use_grad_mean=True, mode="mean"
  )
  opt_init, opt_update = ms_opt.gradient_transformation()
  params = {"a": jnp.zeros([])}
  opt_state = opt_init(params)
  grads = [{"a": jnp.ones([]) * i} for i in [1, 2, 3, 4]]
  assert not ms_opt.has_updated(opt_state)
  for grad in grads[:-1]:
    _, opt_state = opt_update(grad, opt_state, params, weight=1)
    assert not ms_opt.has_updated(opt_state)
  new_params, opt_state = opt_update(grads[-1], opt_state, params, weight=1)
  assert ms_opt.has_updated(opt_state)
  np.testing.assert_array_equal(new_params["a"], 2.5)


def test_multi_steps_skip_not_finite():
  k_steps = 2
  ms_opt = wa.WeightedMultiSteps(
    optax.sgd(1.0),
    k_steps,
    should_skip_update_fn=optax.skip_not_finite,
    mode="mean",
  )
  opt_init, opt_update = ms_opt.gradient_transformation()
  opt_init = jax.jit(opt_init)
  opt_update = jax.jit(functools.partial(opt_update, weight=1))
  params = {"a": jnp.zeros([])}
  opt_state = opt_init(params)

  # test_good_updates
  updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
  assert int(opt_state.mini_step) == 1
  params = optax.apply_updates(params, updates)
  updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
  assert int(opt_state.mini_step) == 0
  params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(params["a"], jnp.negative(jnp.ones([])))
  # test_inf_updates
  updates, opt_state = opt_update(
    {"a": jnp.array(float("inf"))}, opt_state, params
  )
  assert int(opt_state.mini_step) == 0  # No increase in mini_step
  params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(params["a"], jnp.negative(jnp.ones([])))
  # test_nan_updates
  updates, opt_state = opt_update(
    {"a": jnp.full([], float("nan"))}, opt_state, params
  )
  assert int(opt_state.mini_step) == 0  # No increase in mini_step
  params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(params["a"], jnp.negative(jnp.ones([])))
  # test_final_good_updates
  updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
  assert int(opt_state.mini_step) == 1
  params = optax.apply_updates(params, updates)
  updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
  assert int(opt_state.mini_step) == 0
  params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(params["a"], jnp.negative(jnp.full([], 2.0)))
  # This library's addition: the two skipped microbatches are counted.
  assert int(opt_state.skipped) == 2


@pytest.mark.parametrize("case", OPTIMIZERS_TO_TEST, ids=_id)
def test_multi_steps_mixed_precision(case):
  """optax's dtype assertions, unchanged; and (this library's addition) the
  updates are finite wherever ``optax.MultiSteps``' are."""
  opt_name, opt_kwargs = case["opt_name"], case["opt_kwargs"]
  batch_size, x_size, k_steps = 32, 7, 4
  data = jnp.ones([batch_size, x_size])
  loss = Loss()

  def loss_apply(params, data):
    return loss.apply({"params": params}, data)

  opt = getattr(optax, opt_name)(**opt_kwargs)
  ms_opt = wa.WeightedMultiSteps(
    getattr(optax, opt_name)(**opt_kwargs), k_steps, mode="mean"
  )
  ms_opt_init, ms_opt_update = ms_opt.gradient_transformation()
  ms_opt_update = functools.partial(ms_opt_update, weight=1)
  ref = optax.MultiSteps(getattr(optax, opt_name)(**opt_kwargs), k_steps)

  def train_step(data, opt_state, params, opt_update_fn, upd_dtype):
    grad = jax.grad(loss_apply)(params, data)
    grad = jax.tree.map(lambda x: x.astype(upd_dtype), grad)
    return opt_update_fn(grad, opt_state, params)

  def compare_dtypes(tree1, tree2):
    return jax.tree.all(
      jax.tree.map(lambda x, y: x.dtype == y.dtype, tree1, tree2)
    )

  @functools.partial(jax.jit, static_argnums=(1, 2))
  def run(data, upd_dtype, param_dtype):
    """optax's loop for one dtype pair, traced once (one compilation)."""
    params = loss.init(
      {"params": jax.random.key(0)}, data, param_dtype=param_dtype
    )["params"]
    opt_state = opt.init(params)
    ms_opt_state = ms_opt_init(params)
    ref_state = ref.init(params)
    steps = []
    for _ in range(k_steps + 1):
      updates, opt_state = train_step(
        data, opt_state, params, opt.update, upd_dtype
      )
      ms_updates, ms_opt_state = train_step(
        data, ms_opt_state, params, ms_opt_update, upd_dtype
      )
      ref_updates, ref_state = train_step(
        data, ref_state, params, ref.update, upd_dtype
      )
      new_params = optax.apply_updates(params, ms_updates)
      steps.append((updates, ms_updates, ref_updates, params, new_params))
      params = new_params
    return steps

  dtypes = [jnp.float32, jnp.float16, jnp.bfloat16]
  for upd_dtype in dtypes:
    for param_dtype in dtypes:
      data = data.astype(param_dtype)
      for updates, ms_updates, ref_updates, params, new_params in run(
        data, upd_dtype, param_dtype
      ):
        get_dtypes = lambda tree: jax.tree.map(lambda x: x.dtype, tree)
        assert compare_dtypes(updates, ms_updates), (
          "Underlying optimizer and MultiSteps updates dtype must match. "
          f"Got ({get_dtypes(updates)}) vs ({get_dtypes(ms_updates)})."
        )
        assert compare_dtypes(params, new_params), (
          "Updates parameters dtypes must match. "
          f"Got ({get_dtypes(params)}) vs ({get_dtypes(new_params)})."
        )
        for got, want in zip(
          jax.tree.leaves(ms_updates), jax.tree.leaves(ref_updates)
        ):
          assert np.all(np.isfinite(np.asarray(got, np.float32))) or not (
            np.all(np.isfinite(np.asarray(want, np.float32)))
          ), (upd_dtype, param_dtype)


# -- test_gradient_accumulation (alias, factorized, contrib) ---------------------


def _first_update(opt, dtype, params=None, update_kwargs=None):
  """The body of optax's ``test_gradient_accumulation`` cases, up to its
  assertion (traced: the caller jits every case of a list at once)."""
  dtype = jnp.dtype(dtype)
  opt = wa.WeightedMultiSteps(opt, every_k_schedule=4, mode="mean")
  fun = lambda x: jnp.sum(x**2)
  params = jnp.array([1.0, 2.0], dtype=dtype) if params is None else params
  grads = jax.grad(fun)(params)
  state = opt.init(params)
  update_kwargs = update_kwargs(fun, params, grads) if update_kwargs else {}
  updates, _ = opt.update(grads, state, params, weight=1, **update_kwargs)
  return updates, jnp.zeros_like(grads)


def _alias_case(case, dtype):
  def kwargs(fun, params, grads):
    del grads
    if case["opt_name"] == "polyak_sgd":
      return {"value": fun(params)}
    return {}

  return _first_update(
    _alias(case["opt_name"], case["opt_kwargs"]), dtype, update_kwargs=kwargs
  )


def _factorized_case(factorized_dims, dtype):
  dtype = jnp.dtype(dtype)
  params = (
    jnp.ones((129, 129), dtype=dtype)
    if factorized_dims
    else jnp.array([1.0, 2.0], dtype=dtype)
  )
  return _first_update(optax.scale_by_factored_rms(), dtype, params=params)


def _contrib_case(case, dtype):
  fun = lambda x: jnp.sum(x**2)
  opt = _contrib(
    case["opt_name"],
    case["opt_kwargs"],
    case.get("wrapper_name"),
    case.get("wrapper_kwargs"),
  )
  update_fn = (
    functools.partial(opt.update, obj_fn=fun)
    if case["opt_name"] == "sophia"
    else opt.update
  )
  opt = optax.GradientTransformationExtraArgs(opt.init, update_fn)

  def kwargs(fun, params, grads):
    del grads
    if (
      case["opt_name"] in ["momo", "momo_adam"]
      or case.get("wrapper_name") == "reduce_on_plateau"
    ):
      return {"value": fun(params)}
    return {}

  return _first_update(opt, dtype, update_kwargs=kwargs)


_CASES = {
  "alias": (ALIAS_OPTIMIZERS, _alias_case),
  "factorized": ((True, False), _factorized_case),
  "contrib": (CONTRIB_OPTIMIZERS, _contrib_case),
}


def _failures(cases, check) -> list[str]:
  """``check(i)`` for every case: the ids of those that fail, with why."""
  out = []
  for i, case in enumerate(cases):
    try:
      check(i)
    except AssertionError as e:
      name = _id(case) if isinstance(case, dict) else f"factorized_dims={case}"
      out.append(f"{name}: {e}")
  return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("module", list(_CASES))
def test_gradient_accumulation(module, dtype):
  """optax's ``test_gradient_accumulation`` of every optimizer of one list
  (alias, factorized, contrib), traced into one jitted call: one
  compilation per list and dtype; the message names each that fails."""
  cases, body = _CASES[module]
  got = jax.jit(lambda: [body(c, dtype) for c in cases])()
  bad = _failures(cases, lambda i: _assert_trees_all_equal(*got[i]))
  assert not bad, "\n".join(bad)


# -- beyond the port: equal to MultiSteps at weight 1, to the full batch -------

K = 3  # microbatches per window
WINDOWS = 2
ROWS = 4  # rows per (padded) microbatch
SIZES = np.array([[4, 1, 2], [3, 4, 1]])  # valid rows per microbatch


def _equivalence_data():
  r = np.random.default_rng(0)
  x = r.normal(size=(WINDOWS, K, ROWS, 4)).astype(np.float32)
  y = r.normal(size=(WINDOWS, K, ROWS, 3)).astype(np.float32)
  mask = (np.arange(ROWS)[None, None, :] < SIZES[..., None]).astype(np.float32)
  params = {
    "w": r.normal(size=(4, 3)).astype(np.float32),
    "b": (0.1 * r.normal(size=(3,))).astype(np.float32),
  }
  return jax.tree.map(jnp.asarray, (params, x, y, mask))


def _mean_loss(params, x, y, mask):
  err = jnp.sum((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2, -1)
  return jnp.sum(mask * err) / jnp.sum(mask)


def _window_loss(params, x, y, mask):
  flat = lambda a: a.reshape((-1,) + a.shape[2:])
  return _mean_loss(params, flat(x), flat(y), flat(mask))


def _scan_steps(tx, params, x, y, mask, weights, values, kw):
  """Runs ``tx`` over every microbatch; returns every step's updates and
  params."""

  def step(carry, inputs):
    p, s = carry
    xi, yi, mi, wi, vi = inputs
    g = jax.grad(_mean_loss)(p, xi, yi, mi)
    extra = kw(vi)
    if weights is not None:
      extra["weight"] = wi
    u, s = tx.update(g, s, p, **extra)
    p = optax.apply_updates(p, u)
    return (p, s), (u, p)

  flat = lambda a: a.reshape((-1,) + a.shape[2:])
  w = flat(weights) if weights is not None else jnp.zeros(WINDOWS * K)
  v = jnp.repeat(values, K)
  _, (upd, ps) = jax.lax.scan(
    step, (params, tx.init(params)), (flat(x), flat(y), flat(mask), w, v)
  )
  return upd, ps


def _reference(inner, params, x, y, mask, kw):
  """The inner optimizer applied directly to each window's full-batch
  gradient."""

  def step(carry, inputs):
    p, s = carry
    g = jax.grad(_window_loss)(p, *inputs)
    u, s = inner.update(g, s, p, **kw(_window_loss(p, *inputs)))
    p = optax.apply_updates(p, u)
    return (p, s), p

  _, ps = jax.lax.scan(step, (params, inner.init(params)), (x, y, mask))
  return ps


def _extra_args(case):
  name, wrapper = case["opt_name"], case.get("wrapper_name")
  if name in ("polyak_sgd", "momo", "momo_adam") or (
    wrapper == "reduce_on_plateau"
  ):
    return lambda v: {"value": v}
  return lambda v: {}


def _make(case):
  if case in CONTRIB_OPTIMIZERS:
    opt = _contrib(
      case["opt_name"],
      case["opt_kwargs"],
      case.get("wrapper_name"),
      case.get("wrapper_kwargs"),
    )
    if case["opt_name"] == "sophia":
      params, x, y, mask = _equivalence_data()
      obj = lambda p: _window_loss(p, x[0], y[0], mask[0])
      opt = optax.GradientTransformationExtraArgs(
        opt.init, functools.partial(opt.update, obj_fn=obj)
      )
    return opt
  return _alias(case["opt_name"], case["opt_kwargs"])


def _equivalence_case(case):
  """Every step's updates at weight 1 (ours and MultiSteps'), and the
  params after every step with unequal weights and of the reference."""
  params, x, y, mask = _equivalence_data()
  kw = _extra_args(case)
  values = jax.vmap(_window_loss, (None, 0, 0, 0))(params, x, y, mask)
  ones = jnp.ones((WINDOWS, K), jnp.float32)
  ours, _ = _scan_steps(
    wa.WeightedMultiSteps(_make(case), K, mode="mean"),
    params,
    x,
    y,
    mask,
    ones,
    values,
    kw,
  )
  theirs, _ = _scan_steps(
    optax.MultiSteps(_make(case), K), params, x, y, mask, None, values, kw
  )
  _, weighted = _scan_steps(
    wa.WeightedMultiSteps(_make(case), K, mode="mean"),
    params,
    x,
    y,
    mask,
    jnp.sum(mask, -1),
    values,
    kw,
  )
  return ours, theirs, weighted, _reference(_make(case), params, x, y, mask, kw)


# The optimizers whose window updates are compared (factorized: its default
# scale_by_factored_rms; the contrib list includes its wrappers).
EQUIVALENCE = {
  "alias": ALIAS_OPTIMIZERS,
  "contrib": CONTRIB_OPTIMIZERS,
  "factorized": ({"opt_name": "scale_by_factored_rms", "opt_kwargs": {}},),
}


@pytest.mark.parametrize("module", list(EQUIVALENCE))
def test_weight_one_equals_multisteps_unequal_equals_full_batch(module):
  """Every optimizer of one list in one jitted call (one compilation); the
  message names each that fails."""
  cases = EQUIVALENCE[module]
  results = jax.jit(lambda: [_equivalence_case(c) for c in cases])()
  bad = _failures(cases, lambda i: _check_equivalence(*results[i]))
  assert not bad, "\n".join(bad)


def _check_equivalence(ours, theirs, weighted, reference):
  # Weight 1: every step's updates are MultiSteps' (zeros mid-window). The
  # window mean is rounded differently (one division vs optax's running
  # mean): rtol 1e-6, and an absolute 4 float32 ulps of the params (~1),
  # because schedule-free updates are differences of param-sized values and
  # adagrad at learning rate 1 carries the mean's few-ulp rounding into
  # updates of size ~0.1 (the gradients themselves agree to 1e-6).
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-6, atol=5e-7
    )
  # Unequal weights: after each window, the full-batch reference's params.
  at_close = jax.tree.map(lambda p: p[K - 1 :: K], weighted)
  for a, b in zip(jax.tree.leaves(at_close), jax.tree.leaves(reference)):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6
    )
