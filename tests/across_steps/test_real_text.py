"""The real-text example (examples/stdlib_lm): its data pipeline and the
exactness of the token-weighted window gradient on real text.

The references are independent of the code under test: plain-Python byte
counts for the masks, and the full batch's ``jax.grad`` of its token-mean
loss for the window gradients (two AdamW windows for the optimizer-level
claim).
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

# The example lives outside the package: import it from examples/.
sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[2] / "examples")
)

from stdlib_lm import data  # noqa: E402
from stdlib_lm import measure  # noqa: E402
from stdlib_lm import model  # noqa: E402
from stdlib_lm import train  # noqa: E402

import weighted_accum as wa  # noqa: E402

SEQ = 128


@pytest.fixture(scope="module")
def sources():
  return data.stdlib_sources()


@pytest.fixture(scope="module")
def corpus(sources):
  return data.load_corpus(SEQ, sources=sources)


def test_split_is_by_path_and_deterministic(sources, corpus):
  paths = [p for p, _ in sources]
  held = {p for p in paths if data.is_validation(p)}
  assert corpus.num_files == (len(paths) - len(held), len(held))
  assert paths == sorted(paths)
  # A file's split depends on its path alone: any subset agrees.
  subset = paths[::7]
  assert {p for p in subset if data.is_validation(p)} == held & set(subset)
  assert 0.05 < len(held) / len(paths) < 0.15
  assert not any("site-packages" in p or "/test/" in f"/{p}" for p in paths)


def test_documents_tile_the_module():
  text = (
    '"""Doc."""\nimport os\n\n@dec\n@other(1)\ndef f():\n  return 1\n\n'
    "class C:\n  x = 1\n\n  def m(self):\n    pass\n\nasync def g():\n  pass\n"
  )
  docs = data.split_documents(text)
  assert "".join(docs) == text
  assert [d.splitlines()[0] for d in docs] == [
    '"""Doc."""',
    "@dec",
    "class C:",
    "  def m(self):",
    "async def g():",
  ]


def test_rows_masks_and_counts_match_plain_python(sources):
  docs = [d for _, t in sources[:40] for d in data.split_documents(t)]
  rows = data.to_rows([data.encode(d) for d in docs], SEQ)
  for i, doc in enumerate(docs):
    raw = list(doc.encode("utf-8"))
    n = min(len(raw), SEQ)  # BOS + bytes: len(raw) targets, truncated
    assert rows.mask[i].tolist() == [1.0] * n + [0.0] * (SEQ - n)
    assert rows.tokens[i].tolist() == [256] + raw[:SEQ] + [0] * (SEQ - n)


def test_lengths_vary_and_microbatches_are_unequal(corpus):
  lengths = corpus.train_doc_lengths
  assert lengths.max() / lengths.min() >= 1000  # three orders of magnitude
  order = data.batch_order(len(corpus.train), 16, 8, seed=0)
  smallest = []
  for idx in order:
    batch = corpus.train.take(idx)
    per_row = [int(sum(r)) for r in batch["mask"].tolist()]
    for k in (4, 16):
      grouped = data.group_by_length(batch, k)
      assert sorted(map(tuple, grouped["tokens"])) == sorted(
        map(tuple, batch["tokens"])
      )
      counts = [
        int(data.microbatch(grouped, m, k)["mask"].sum()) for m in range(k)
      ]
      assert sum(counts) == sum(per_row)
      assert counts == sorted(counts)  # shortest rows first
    smallest.append(min(counts))  # K = 16: one row each
  assert min(smallest) <= SEQ / 2  # beside full rows of SEQ targets


@pytest.fixture(scope="module")
def tiny(corpus):
  s = train.Settings(
    model=model.Config(seq_len=SEQ, dim=32, layers=1, heads=2),
    batch_size=8,
    steps=2,
    peak_lr=1e-2,
  )
  ex = train.Experiment(s, corpus)
  ex.full_grad = jax.jit(jax.grad(lambda p, b: ex.loss_mean(p, b)[0]))
  return ex


def test_weighted_window_gradient_is_the_full_batch_gradient(tiny):
  batch = tiny.batch(0, 4)
  full = tiny.full_grad(tiny.params0, batch)
  equal, weighted, tokens = measure.window_grads(tiny, tiny.params0, batch, 4)
  assert len(set(tokens)) > 1
  assert measure.relative_error(weighted, full) <= 1e-5
  assert measure.relative_error(equal, full) >= 1e-2


def test_weighted_multi_steps_follows_full_batch_adamw(tiny):
  tx = train.optimizer(tiny.s)

  @jax.jit
  def adamw_update(grads, opt, params):  # the reference: full-batch AdamW
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  params, opt = tiny.params0, tx.init(tiny.params0)
  for step in range(2):  # two windows: Adam's first step hides weighting
    grads = tiny.full_grad(params, tiny.batch(step))
    params, opt = adamw_update(grads, opt, params)
  run = tiny.runner("weighted", 4)
  assert isinstance(run.tx, wa.WeightedMultiSteps)
  state = run.init()
  for step in range(2):
    state, _ = run.step(state, tiny.batch(step, 4))
  moved = jax.tree.map(jnp.subtract, params, tiny.params0)
  delta = jax.tree.map(jnp.subtract, state[0], tiny.params0)
  assert measure.relative_error(delta, moved) <= 1e-5
  for step in range(2):  # both windows' microbatches are unequal
    batch = tiny.batch(step, 4)
    counts = {
      float(data.microbatch(batch, m, 4)["mask"].sum()) for m in range(4)
    }
    assert len(counts) > 1
