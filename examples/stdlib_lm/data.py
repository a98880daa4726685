"""The corpus: the running interpreter's own standard-library sources.

Every Python installation ships its standard library as ``.py`` files, so the
corpus needs no download and nobody here wrote it. Each module is split into
documents (its header, and each ``def`` or ``class`` block, methods
included, with its decorators), which are byte-encoded, one padded row per
document. A row's mask marks its real target tokens, so
rows, and the microbatches made of them, hold very different numbers of
target tokens.

The split into training and validation files is by a hash of each file's
relative path: deterministic, and independent of the order files are read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import re
import sysconfig

import numpy as np

BOS = 256  # the token that starts every document; bytes are 0..255
VOCAB = 257
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
_BLOCK_START = re.compile(r"[ \t]*(?:def |class |async def |@)")


@dataclasses.dataclass(frozen=True)
class Rows:
  """Fixed-length training rows.

  Attributes:
    tokens: ``int32[N, seq_len + 1]``; inputs are ``tokens[:, :-1]`` and
      targets ``tokens[:, 1:]``.
    mask: ``float32[N, seq_len]``, 1 where the target is a real token.
  """

  tokens: np.ndarray
  mask: np.ndarray

  def __len__(self) -> int:
    return self.tokens.shape[0]

  def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
    """The rows at ``index`` as a batch dict ``{"tokens", "mask"}``."""
    return {"tokens": self.tokens[index], "mask": self.mask[index]}


def stdlib_sources(root: str | None = None) -> list[tuple[str, str]]:
  """Reads the standard library's ``.py`` files.

  Args:
    root: the directory to read; by default the running interpreter's
      ``sysconfig.get_paths()["stdlib"]``.

  Returns:
    ``(relative posix path, text)`` pairs sorted by path; test suites and
    installed third-party packages are left out.
  """
  base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
  out = []
  for path in base.rglob("*.py"):
    rel = path.relative_to(base)
    if _SKIP_DIRS & set(rel.parts[:-1]):
      continue
    text = path.read_bytes().decode("utf-8", errors="replace")
    out.append((rel.as_posix(), text))
  return sorted(out)


def is_validation(rel_path: str, fraction: float = 0.1) -> bool:
  """Whether a file belongs to the validation split (by a hash of its path)."""
  digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


def split_documents(text: str) -> list[str]:
  """Splits a module into its header and its ``def``/``class`` blocks.

  A block starts at a line whose first word (after any indentation) is
  ``def``, ``class``, ``async def`` or a decorator; a decorator's ``def``
  stays with it, and a class's own block ends where its first method
  starts. Blank-only documents are dropped.
  """
  docs, current, in_decorator = [], [], False
  for line in text.splitlines(keepends=True):
    starts = bool(_BLOCK_START.match(line))
    if starts and not in_decorator and current:
      docs.append("".join(current))
      current = []
    current.append(line)
    if line.strip():
      in_decorator = line.lstrip().startswith("@")
  docs.append("".join(current))
  return [d for d in docs if d.strip()]


def encode(doc: str) -> np.ndarray:
  """A document's tokens: BOS, then its UTF-8 bytes."""
  data = np.frombuffer(doc.encode("utf-8"), np.uint8).astype(np.int32)
  return np.concatenate([np.array([BOS], np.int32), data])


def to_rows(docs: list[np.ndarray], seq_len: int) -> Rows:
  """One padded row per document: its first ``seq_len + 1`` tokens.

  A document of ``n`` tokens has ``min(n - 1, seq_len)`` targets in its row;
  longer documents are truncated (padding and truncating each example to a
  maximum length, as fine-tuning pipelines do). Cutting long documents into
  several rows instead would make almost every row full: here the rows'
  target counts follow the documents' lengths.
  """
  tokens = np.zeros((len(docs), seq_len + 1), np.int32)
  mask = np.zeros((len(docs), seq_len), np.float32)
  for i, doc in enumerate(docs):
    piece = doc[: seq_len + 1]
    tokens[i, : len(piece)] = piece
    mask[i, : len(piece) - 1] = 1.0
  return Rows(tokens, mask)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The training and validation rows and the documents' lengths."""

  train: Rows
  valid: Rows
  train_doc_lengths: np.ndarray
  num_files: tuple[int, int]  # (training, validation)


def load_corpus(
  seq_len: int,
  *,
  val_fraction: float = 0.1,
  root: str | None = None,
  sources: list[tuple[str, str]] | None = None,
) -> Corpus:
  """Reads, splits and cuts the standard library into rows.

  Args:
    seq_len: targets per row.
    val_fraction: the share of files (by path hash) held out.
    root: the directory to read (default: the interpreter's stdlib).
    sources: ``(path, text)`` pairs already read by :func:`stdlib_sources`
      (then ``root`` is not read).

  Returns:
    The :class:`Corpus`.
  """
  split = {True: [], False: []}
  files = {True: 0, False: 0}
  for rel, text in sources or stdlib_sources(root):
    held_out = is_validation(rel, val_fraction)
    files[held_out] += 1
    split[held_out] += [encode(d) for d in split_documents(text)]
  return Corpus(
    train=to_rows(split[False], seq_len),
    valid=to_rows(split[True], seq_len),
    train_doc_lengths=np.array([len(d) for d in split[False]]),
    num_files=(files[False], files[True]),
  )


def batch_order(num_rows: int, batch_size: int, steps: int, seed: int):
  """The row indices of each step's global batch (epochs reshuffled).

  Returns:
    ``int[steps, batch_size]``: the same for every run with the same seed.
  """
  rng = np.random.default_rng(seed)
  need = steps * batch_size
  perms = [rng.permutation(num_rows) for _ in range(-(-need // num_rows))]
  return np.concatenate(perms)[:need].reshape(steps, batch_size)


def group_by_length(batch: dict, k: int) -> dict:
  """Reorders a batch so that microbatch ``m`` (rows ``m::k``) holds the
  ``m``-th share of its rows by target count (shortest first).

  This is what length-grouped batching does to cut padding (short rows with
  short ones); it leaves the global batch, and so its full-batch gradient,
  unchanged, and makes the microbatches' token counts as unequal as the
  batch allows. Rows ``m::k`` is the split both
  ``wa.microbatched_value_and_grad`` and :func:`microbatch` use.
  """
  rows = batch["mask"].shape[0]
  order = np.argsort(batch["mask"].sum(1), kind="stable")
  perm = order.reshape(k, rows // k).T.reshape(-1)
  return {name: x[perm] for name, x in batch.items()}


def microbatch(batch: dict, m: int, k: int) -> dict:
  """Microbatch ``m`` of ``k``: rows ``m::k``."""
  return {name: x[m::k] for name, x in batch.items()}
