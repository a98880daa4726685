"""Collectives and fusions a compiled XLA program executes per step.

``hlo_stats(compiled)`` reads the optimised HLO of a compiled executable
(``jax.jit(f).lower(...).compile()``) or its text (``compiled.as_text()``)
and counts, per EXECUTED step, every all-reduce, reduce-scatter, all-gather,
all-to-all and collective-permute with its bytes: per device, the bytes of
the op's operands (for a reduce-scatter its unscattered input, for an
all-gather its local shard). Control flow is followed from ``ENTRY``:

- a ``while`` runs its body ``n`` times and its condition ``n + 1`` times,
  ``n`` read from XLA's ``known_trip_count`` (in the op's
  ``backend_config``) or, when XLA does not know it (a loop whose bound is a
  traced value), given by the caller (``trip_count=``); loops nest;
- a ``conditional`` runs one branch: by default the branch with the most
  collective bytes is counted (an upper bound per step), or every branch
  with ``branches="all"``;
- ``call``, ``fusion``, ``async-start`` and ``custom-call`` computations run
  once per execution of the instruction that calls them; reducers
  (``to_apply`` of an all-reduce, reduce, scatter, sort, ...) are not
  followed.

Asynchronous forms count once: ``all-reduce-start``/``-done`` (and the
all-gather, reduce-scatter, all-to-all, collective-permute pairs) count at
the ``-start``; a generic ``async-start`` counts the collective inside the
computation it calls, and its ``async-update``/``async-done`` nothing.

``fusion`` instructions are counted per computation reached from ``ENTRY``
(fused computations themselves excluded): the kernels XLA emits there, and
how often each computation runs per step.

Example::

  stats = hlo_stats(jax.jit(step).lower(params, batch).compile())
  stats.count("all-reduce"), stats.nbytes("all-reduce")
  stats.summary()          # a JSON-ready dict
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import json
import math
import re
from typing import Any

KINDS = (
  "all-reduce",
  "reduce-scatter",
  "all-gather",
  "all-to-all",
  "collective-permute",
)

__all__ = [
  "KINDS",
  "Collective",
  "HloStats",
  "all_reduced_bytes",
  "hlo_stats",
  "mesh_groups",
  "parse_replica_groups",
  "shape_bytes",
  "tree_bytes",
]

# Bits per element of each HLO primitive type.
_BITS = {
  "pred": 8,
  "s1": 1,
  "u1": 1,
  "s2": 2,
  "u2": 2,
  "s4": 4,
  "u4": 4,
  "s8": 8,
  "u8": 8,
  "s16": 16,
  "u16": 16,
  "f16": 16,
  "bf16": 16,
  "s32": 32,
  "u32": 32,
  "f32": 32,
  "s64": 64,
  "u64": 64,
  "f64": 64,
  "c64": 64,
  "c128": 128,
  "token": 0,
}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*(\(.*)?\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*")
_COMMENT = re.compile(r"/\*.*?\*/")  # /*index=5*/ in long operand lists
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


def _bits(dtype: str) -> int:
  if dtype in _BITS:
    return _BITS[dtype]
  m = re.match(r"f(\d+)", dtype)  # f8e4m3fn, f8e5m2, f4e2m1fn, ...
  if m:
    return int(m.group(1))
  raise ValueError(f"unknown HLO element type {dtype!r}")


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string, e.g. ``f32[8,128]{1,0}`` or a tuple
  ``(f32[16]{0}, s32[])`` (the sum of its arrays; layouts ignored; a
  bounded dynamic dimension ``<=n`` counts ``n``)."""
  total_bits = 0
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in dims.split(","):
      d = d.strip().lstrip("<=")
      if d:
        n *= int(d)
    total_bits += n * _bits(dtype)
  return (total_bits + 7) // 8


def _balanced(s: str, i: int) -> int:
  """Index just past the bracket group opening at ``s[i]`` (brackets inside
  a quoted string, e.g. a JSON ``backend_config``, do not count)."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack, j = [], i
  while j < len(s):
    c = s[j]
    if c == '"':
      j += 1
      while j < len(s) and s[j] != '"':
        j += 2 if s[j] == "\\" else 1
    elif c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return j + 1
    j += 1
  raise ValueError(f"unbalanced HLO text: {s[i : i + 80]!r}")


def _split_top(s: str) -> list[str]:
  """``s`` split at the commas outside any bracket or string."""
  out, depth, cur, quoted = [], 0, [], False
  for c in s:
    if quoted:
      cur.append(c)
      quoted = c != '"'
      continue
    if c == '"':
      quoted = True
    elif c in "({[":
      depth += 1
    elif c in ")}]":
      depth -= 1
    elif c == "," and depth == 0:
      out.append("".join(cur).strip())
      cur = []
      continue
    cur.append(c)
  if "".join(cur).strip():
    out.append("".join(cur).strip())
  return out


@dataclasses.dataclass(frozen=True)
class _Instr:
  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attrs: dict[str, str]


def _parse_instr(line: str) -> _Instr | None:
  m = _NAME.match(line)
  if not m:
    return None
  rest = line[m.end() :]
  if rest.startswith("("):
    end = _balanced(rest, 0)
    shape, rest = rest[:end], rest[end:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
    rest = rest.lstrip()
  k = rest.find("(")
  if k <= 0:
    return None
  opcode = rest[:k].strip()
  end = _balanced(rest, k)
  operands = tuple(_split_top(rest[k + 1 : end - 1]))
  attrs = {}
  for item in _split_top(rest[end:].lstrip(", ")):
    key, eq, value = item.partition("=")
    if eq:
      attrs[key.strip()] = value.strip()
  return _Instr(m.group(1), shape, opcode, operands, attrs)


def _parse_module(text: str) -> tuple[dict[str, list[_Instr]], str, dict]:
  """The computations (name -> instructions), the entry's name and the
  module header's attributes."""
  comps: dict[str, list[_Instr]] = {}
  entry, header, cur = None, {}, None
  for line in text.splitlines():
    if line.startswith("HloModule"):
      for key in ("num_partitions", "replica_count"):
        m = re.search(rf"\b{key}=(\d+)", line)
        if m:
          header[key] = int(m.group(1))
      continue
    if cur is None:
      m = _HEADER.match(line)
      if m and "=" not in line.split("(")[0]:
        cur = m.group(2)
        comps[cur] = []
        if m.group(1):
          entry = cur
      continue
    if line.startswith("}"):
      cur = None
      continue
    ins = _parse_instr(_COMMENT.sub("", line))
    if ins is not None:
      comps[cur].append(ins)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry, header


def _names(value: str) -> list[str]:
  """Computation names in an attribute value: ``%a`` or ``{%a, %b}``."""
  return [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v]


def _operand_name(op: str) -> str:
  """The instruction an operand refers to (``%x`` or ``f32[2]{0} %x``)."""
  return op.split()[-1].lstrip("%")


def _iota_groups(text: str) -> tuple[tuple[int, ...], ...]:
  """``[G,S]<=[d0,d1,...]T(p0,p1,...)``: ``iota(prod d).reshape(d)``,
  transposed by ``p``, flattened and cut into G groups of S."""
  m = re.fullmatch(
    r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip()
  )
  if not m:
    raise ValueError(f"unreadable replica_groups {text!r}")
  shape = [int(v) for v in m.group(1).split(",")]
  dims = [int(v) for v in m.group(2).split(",")]
  ids = list(range(math.prod(dims)))
  if m.group(3):
    perm = [int(v) for v in m.group(3).split(",")]
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    tdims = [dims[q] for q in perm]
    out = []
    for flat in range(len(ids)):
      rem, idx = flat, []
      for d in reversed(tdims):
        idx.append(rem % d)
        rem //= d
      idx.reverse()  # index into the transposed array
      out.append(sum(idx[k] * strides[perm[k]] for k in range(len(perm))))
    ids = out
  size = shape[-1]
  return tuple(tuple(ids[i : i + size]) for i in range(0, len(ids), size))


def _device_order(spec: str, total: int) -> list[int]:
  """The device ids in mesh order from a ``device_ids=`` value: the iota
  form ``[4,2]T(1,0)`` (``iota(8).reshape(4, 2).T``, flattened) or a list
  ``0,2,4,...``."""
  spec = spec.strip()
  if spec.startswith("["):
    dims, _, rest = spec[1:].partition("]")
    (order,) = _iota_groups(f"[1,{total}]<=[{dims}]{rest}")
    return list(order)
  return [int(v) for v in spec.split(",")]


def _mesh_axes_groups(text: str) -> tuple[tuple[int, ...], ...]:
  """``mesh['a'=4,'b'=2] {'a'}`` (optionally ``mesh[...], device_ids=(...)
  {...}``): the groups of a reduction over the listed axes of that mesh,
  devices numbered in mesh order (or as ``device_ids`` lists them). A
  sub-axis ``'a':(p)s`` is the size-``s`` factor of axis ``a`` above its
  innermost ``p`` (the axis read as ``[n / (p s), s, p]``)."""
  m = re.fullmatch(
    r"mesh\[([^\]]*)\](?:\s*,\s*device_ids=\((.*)\))?\s*\{([^{}]*)\}",
    text.strip(),
  )
  if not m:
    raise ValueError(f"unreadable replica_groups {text!r}")
  sizes = {}
  for item in m.group(1).split(","):
    name, _, size = item.partition("=")
    sizes[name.strip().strip("'")] = int(size)
  # Each reduced axis split into (outer, sub, inner) factors.
  factors, axes = {}, []
  for item in m.group(3).split(","):
    item = item.strip()
    if not item:
      continue
    sm = re.fullmatch(r"'([^']*)'(?::\((\d+)\)(\d+))?", item)
    if not sm:
      raise ValueError(f"unreadable replica_groups {text!r}")
    name = sm.group(1)
    if sm.group(2):
      pre, size = int(sm.group(2)), int(sm.group(3))
    else:
      pre, size = 1, sizes[name]
    factors[name] = (sizes[name] // (pre * size), size, pre)
    axes.append(f"{name}#sub")
  flat = {}
  for name, n in sizes.items():
    if name in factors:
      outer, sub, inner = factors[name]
      flat[f"{name}#outer"], flat[f"{name}#sub"] = outer, sub
      flat[f"{name}#inner"] = inner
    else:
      flat[name] = n
  total = math.prod(sizes.values())
  order = (
    list(range(total))
    if m.group(2) is None
    else _device_order(m.group(2), total)
  )
  groups = [sorted(order[i] for i in g) for g in mesh_groups(flat, tuple(axes))]
  return tuple(tuple(g) for g in sorted(groups))


def parse_replica_groups(
  text: str, num_devices: int
) -> tuple[tuple[int, ...], ...]:
  """The device ids of each group of a ``replica_groups=`` value: the list
  form ``{{0,1},{2,3}}`` (``{}``: all ``num_devices``), the iota form
  ``[2,2]<=[4]`` or the mesh-axes form ``mesh['a'=2,'b'=2] {'a'}``."""
  return _replica_groups({"replica_groups": text}, num_devices)


def _replica_groups(
  attrs: dict[str, str], everyone: int
) -> tuple[tuple[int, ...], ...] | None:
  """The device ids of each replica group (``{{0,1},{2,3}}`` or the iota
  form ``[2,2]<=[4]``); an empty list means every device. None for a
  collective-permute (``source_target_pairs`` instead)."""
  groups = attrs.get("replica_groups")
  if groups is None:
    return None
  groups = groups.strip()
  if groups.startswith("["):
    return _iota_groups(groups)
  if groups.startswith("mesh["):
    if "device_ids" in attrs:  # split off at the comma by the attribute reader
      groups = f"{groups}, device_ids={attrs['device_ids']}"
    return _mesh_axes_groups(groups)
  inner = re.findall(r"\{([^{}]*)\}", groups)
  if not inner or not inner[0].strip():
    return (tuple(range(everyone)),)
  return tuple(tuple(int(v) for v in g.split(",")) for g in inner)


def mesh_groups(mesh: Any, axes: str | tuple[str, ...]) -> frozenset:
  """The replica groups of a reduction over ``axes`` of ``mesh`` (a
  ``jax.sharding.Mesh`` or a dict of axis sizes in mesh order): sets of
  device positions in the mesh's flattened device array, which are the
  partition ids of a program jitted over that mesh. Compare with
  :attr:`Collective.groups` (or pass as ``groups=`` to the counts)."""
  sizes = dict(mesh.shape) if hasattr(mesh, "shape") else dict(mesh)
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  names = list(sizes)
  unknown = [a for a in axes if a not in sizes]
  if unknown:
    raise ValueError(f"axes {unknown} not in the mesh's {names}")
  strides = {
    a: math.prod(sizes[b] for b in names[i + 1 :]) for i, a in enumerate(names)
  }
  kept = [a for a in names if a not in axes]
  groups = set()
  for outer in range(math.prod(sizes[a] for a in kept)):
    base, rem = 0, outer
    for a in reversed(kept):
      base += (rem % sizes[a]) * strides[a]
      rem //= sizes[a]
    members = [base]
    for a in axes:
      members = [m + j * strides[a] for m in members for j in range(sizes[a])]
    groups.add(frozenset(members))
  return frozenset(groups)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the compiled program.

  Attributes:
    kind: one of :data:`KINDS`.
    name: the instruction's name in the HLO.
    computation: the computation holding it.
    nbytes: its operands' bytes per device, for one execution.
    executions: how many times it runs per step.
    replica_groups: the device ids of each replica group (None for a
      collective-permute).
  """

  kind: str
  name: str
  computation: str
  nbytes: int
  executions: int
  replica_groups: tuple[tuple[int, ...], ...] | None

  @property
  def group_size(self) -> int | None:
    """Devices per replica group (None for a collective-permute)."""
    return len(self.replica_groups[0]) if self.replica_groups else None

  @property
  def groups(self) -> frozenset | None:
    """The replica groups as a set of sets (compare with
    :func:`mesh_groups`)."""
    if self.replica_groups is None:
      return None
    return frozenset(frozenset(g) for g in self.replica_groups)

  def ring_bytes(self) -> float:
    """Bytes each device sends per execution with a ring algorithm over
    its group of ``n``: all-reduce ``2 (n-1)/n B``, reduce-scatter and
    all-to-all ``(n-1)/n B``, all-gather ``(n-1) B`` (``B`` its operand
    bytes), collective-permute ``B``."""
    n = self.group_size or 1
    b = self.nbytes
    return {
      "all-reduce": 2 * (n - 1) / n * b,
      "reduce-scatter": (n - 1) / n * b,
      "all-to-all": (n - 1) / n * b,
      "all-gather": (n - 1) * b,
      "collective-permute": b,
    }[self.kind]


@dataclasses.dataclass(frozen=True)
class HloStats:
  """What :func:`hlo_stats` found.

  Attributes:
    collectives: every collective reached from ENTRY, with its executions
      per step.
    fusions: per computation reached from ENTRY (fused computations
      excluded): ``(fusion instructions in it, its executions per step)``.
    loops: per ``while`` instruction, the trip count used.
  """

  collectives: tuple[Collective, ...]
  fusions: dict[str, tuple[int, int]]
  loops: dict[str, int]

  def select(
    self, kind: str | None = None, groups: frozenset | None = None
  ) -> list[Collective]:
    """The collectives of ``kind`` (default: every kind) whose replica
    groups are ``groups`` (default: any; see :func:`mesh_groups`)."""
    if kind is not None and kind not in KINDS:
      raise ValueError(f"unknown collective kind {kind!r}; one of {KINDS}")
    return [
      c
      for c in self.collectives
      if kind in (None, c.kind) and groups in (None, c.groups)
    ]

  def count(self, kind: str | None = None, groups: frozenset | None = None):
    """Collectives of ``kind`` over ``groups`` (default: all) executed per
    step."""
    return sum(c.executions for c in self.select(kind, groups))

  def nbytes(self, kind: str | None = None, groups: frozenset | None = None):
    """Their operand bytes per device per step."""
    return sum(c.executions * c.nbytes for c in self.select(kind, groups))

  def static_count(
    self, kind: str | None = None, groups: frozenset | None = None
  ) -> int:
    """Collective instructions of ``kind`` in the program (each once)."""
    return len({(c.computation, c.name) for c in self.select(kind, groups)})

  def in_loops(
    self, kind: str | None = None, groups: frozenset | None = None
  ) -> int:
    """Collectives of ``kind`` executed per step by instructions that run
    more than once per step (inside a loop)."""
    return sum(
      c.executions for c in self.select(kind, groups) if c.executions > 1
    )

  def ring_bytes(
    self, kind: str | None = None, groups: frozenset | None = None
  ) -> float:
    """Bytes each device sends per step with ring algorithms (see
    :meth:`Collective.ring_bytes`)."""
    return sum(c.executions * c.ring_bytes() for c in self.select(kind, groups))

  def executed_fusions(self) -> int:
    """Fusion instructions executed per step."""
    return sum(n * runs for n, runs in self.fusions.values())

  def summary(self) -> dict[str, Any]:
    """A JSON-ready dict: per kind, executed count, bytes and count in
    loops; fusions executed per step; the loops' trip counts."""
    out = {
      k: dict(
        count=self.count(k),
        bytes=self.nbytes(k),
        in_loops=self.in_loops(k),
        static=self.static_count(k),
      )
      for k in KINDS
      if self.select(k)
    }
    out["executed_fusions"] = self.executed_fusions()
    out["loops"] = dict(self.loops)
    return json.loads(json.dumps(out))


def _kind(opcode: str) -> str | None:
  base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
  return base if base in KINDS else None


class _Walker:
  def __init__(self, comps, header, trip_count, branches):
    self.comps = comps
    self.everyone = header.get("num_partitions", 1) * header.get(
      "replica_count", 1
    )
    self.trip_count = trip_count
    self.branches = branches
    self.ops: dict[tuple[str, str], list[Any]] = {}
    self.fusions: dict[str, list[int]] = {}
    self.loops: dict[str, int] = {}
    self.shapes = {
      c: {i.name: i.shape for i in instrs} for c, instrs in comps.items()
    }

  def _trips(self, ins: _Instr) -> int:
    m = _TRIP.search(ins.attrs.get("backend_config", ""))
    if m:
      return int(m.group(1))
    tc = self.trip_count
    if isinstance(tc, Mapping):
      if ins.name in tc:
        return int(tc[ins.name])
    elif tc is not None:
      return int(tc)
    raise ValueError(
      f"while loop {ins.name!r} has no known_trip_count in its "
      "backend_config; pass trip_count= (an int for every such loop, or a "
      "dict by while instruction name)."
    )

  def _operand_bytes(self, comp: str, ins: _Instr) -> int:
    total = 0
    for op in ins.operands:
      parts = op.split()
      if len(parts) > 1:  # operands printed with their shape
        total += shape_bytes(" ".join(parts[:-1]))
        continue
      name = _operand_name(op)
      if name not in self.shapes[comp]:
        raise ValueError(f"operand {name!r} of {ins.name!r} not found")
      total += shape_bytes(self.shapes[comp][name])
    return total

  def cost(self, comp: str) -> tuple[int, int]:
    """Collective bytes and count of one execution of ``comp`` (for
    choosing a conditional's branch), computed by a dry walk."""
    sub = _Walker.__new__(_Walker)
    sub.__dict__.update(self.__dict__)
    sub.ops, sub.fusions, sub.loops = {}, {}, {}
    sub.walk(comp, 1, fused=False)
    return (
      sum(b * n for b, n, *_ in sub.ops.values()),
      sum(n for _, n, *_ in sub.ops.values()),
    )

  def walk(self, comp: str, runs: int, *, fused: bool) -> None:
    if comp not in self.comps:
      raise ValueError(f"computation {comp!r} not found in the HLO text")
    if not fused:
      entry = self.fusions.setdefault(comp, [0, 0])
      entry[0] = sum(i.opcode == "fusion" for i in self.comps[comp])
      entry[1] += runs
    for ins in self.comps[comp]:
      kind = _kind(ins.opcode)
      if kind is not None:
        rec = self.ops.setdefault(
          (comp, ins.name),
          [
            self._operand_bytes(comp, ins),
            0,
            kind,
            _replica_groups(ins.attrs, self.everyone),
          ],
        )
        rec[1] += runs
      a = ins.attrs
      if ins.opcode == "while":
        n = self._trips(ins)
        self.loops[ins.name] = n
        self.walk(_names(a["body"])[0], runs * n, fused=fused)
        self.walk(_names(a["condition"])[0], runs * (n + 1), fused=fused)
      elif ins.opcode == "conditional":
        if "branch_computations" in a:
          branches = _names(a["branch_computations"])
        else:
          branches = _names(a["true_computation"]) + _names(
            a["false_computation"]
          )
        if self.branches == "max":
          branches = [max(branches, key=self.cost)]
        for b in branches:
          self.walk(b, runs, fused=fused)
      elif ins.opcode == "call":
        for c in _names(a.get("to_apply", "")):
          self.walk(c, runs, fused=fused)
      elif ins.opcode == "fusion":
        for c in _names(a.get("calls", "")):
          self.walk(c, runs, fused=True)
      elif ins.opcode == "async-start" or ins.opcode == "custom-call":
        key = "calls" if ins.opcode == "async-start" else "called_computations"
        for c in _names(a.get(key, "")):
          self.walk(c, runs, fused=fused)
      # async-update / async-done and *-done carry no new work; reducers
      # (to_apply of reduce, all-reduce, scatter, sort, map) are not walked.


def hlo_stats(
  compiled: Any,
  *,
  trip_count: int | Mapping[str, int] | None = None,
  branches: str = "max",
) -> HloStats:
  """Collectives and fusions executed per step by a compiled program.

  Args:
    compiled: a compiled executable (``jax.jit(f).lower(...).compile()``),
      or its HLO text (``compiled.as_text()``).
    trip_count: the trip count of each ``while`` whose ``backend_config``
      has no ``known_trip_count``: an int for all of them, or a dict by
      while instruction name. A loop XLA knows uses XLA's count.
    branches: ``"max"``: a conditional counts its branch with the most
      collective bytes (an upper bound per step); ``"all"``: every branch.

  Returns:
    An :class:`HloStats`.

  Raises:
    ValueError: for a loop of unknown trip count without ``trip_count``, or
      HLO text this parser cannot read.
  """
  if branches not in ("max", "all"):
    raise ValueError(f"branches={branches!r}: expected 'max' or 'all'")
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  comps, entry, header = _parse_module(text)
  w = _Walker(comps, header, trip_count, branches)
  w.walk(entry, 1, fused=False)
  collectives = tuple(
    Collective(kind, name, comp, nbytes, runs, group)
    for (comp, name), (nbytes, runs, kind, group) in w.ops.items()
  )
  fusions = {c: (n, runs) for c, (n, runs) in w.fusions.items()}
  return HloStats(collectives, fusions, dict(w.loops))


def all_reduced_bytes(
  compiled: Any, groups: frozenset | None = None, **kwargs: Any
) -> int:
  """Shorthand: all-reduce plus reduce-scatter operand bytes per device
  per step over ``groups`` (default: any; see :func:`mesh_groups`), what a
  gradient reduction moves either way. ``kwargs`` go to
  :func:`hlo_stats`."""
  s = (
    compiled
    if isinstance(compiled, HloStats)
    else hlo_stats(compiled, **kwargs)
  )
  return s.nbytes("all-reduce", groups) + s.nbytes("reduce-scatter", groups)


def tree_bytes(tree: Any) -> int:
  """Bytes of a pytree of arrays (or ``jax.ShapeDtypeStruct``): what one
  reduction of it moves per device, when replicated."""
  import jax  # pylint: disable=g-import-not-at-top

  return sum(
    math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(tree)
  )
