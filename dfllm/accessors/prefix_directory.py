"""Which engine each row of a job goes to: its prefix group's engine, within a balance bound.

A :class:`PrefixDirectory` is one job's placement state: the engines (Dask worker
addresses), the work placed on each so far, and which engine each known prefix key went to
(a row's keys are its prompt's prefix-cache block hashes at a few depths, see
:mod:`dfllm.tasks.prefix_keys`). :meth:`PrefixDirectory.place` places one partition's rows,
in row order:

- a row whose longest known prefix covers at least ``min_share`` of its prompt tokens goes
  to that prefix's engine (its *group*: the rows sharing that prefix), unless that engine's
  work would then exceed ``(1 + balance)`` times the mean (the larger of the mean so far and
  the job's estimated mean: the average work of the partitions placed so far, times the
  job's partitions, over the engines): then the group is *split*, the row goes to the
  least loaded engine, and the placement says so (:attr:`Placement.split`);
- any other row goes to the least loaded engine (the lowest-numbered one on ties), and its
  keys not yet known now name that engine.

**The bound.** Every engine's work stays within ``(1 + balance)`` times the job's mean plus
one row's work, as long as the estimate does not overshoot the final mean (partitions of
similar work); on a job without shared prefixes every row goes to the least loaded engine,
and the engines' work is within one row of each other. Work is prompt tokens plus the tokens
a row may generate. The directory keeps at most ``max_keys`` keys (the oldest are dropped:
an engine's prefix cache does not keep its oldest prefixes either).

Pure Python (no Dask): :mod:`dfllm.accessors.prefix_placement` keeps a job's directory on
the Dask scheduler and calls :meth:`PrefixDirectory.place` from each partition's task.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from dfllm.tasks.prefix_keys import RowKeys


@dataclass(frozen=True)
class PlacementSettings:
    """Prefix-aware placement's settings (Dask configuration ``dfllm.prefix-placement``,
    see :func:`dfllm.accessors.prefix_placement.placement_settings`): ``enabled``,
    ``balance`` (the bound above the mean work, as a fraction), ``min_share`` (the
    fraction of a row's prompt its group's prefix must cover to keep it on the group's
    engine) and ``max_keys`` (the directory's size)."""

    enabled: bool = True
    balance: float = 0.2
    min_share: float = 0.5
    max_keys: int = 65536

    def __post_init__(self) -> None:
        if not isinstance(self.balance, (int, float)) or not self.balance >= 0:
            raise ValueError(f"prefix placement: balance must be a number >= 0, got {self.balance!r}")
        if not isinstance(self.min_share, (int, float)) or not 0 <= self.min_share <= 1:
            raise ValueError(f"prefix placement: min_share must be in [0, 1], got {self.min_share!r}")
        if isinstance(self.max_keys, bool) or not isinstance(self.max_keys, int) or self.max_keys < 1:
            raise ValueError(f"prefix placement: max_keys must be a positive integer, got {self.max_keys!r}")


@dataclass(frozen=True)
class Placement:
    """One partition's placement: ``engines[i]`` is row ``i``'s engine (an address);
    ``split`` counts its rows placed away from their group's engine to keep the balance."""

    engines: list[str]
    split: int


class PrefixDirectory:
    """One job's placement state (picklable; see the module's docstring)."""

    def __init__(self, npartitions: int, settings: PlacementSettings = PlacementSettings()):
        self.npartitions = max(1, int(npartitions))
        self.settings = settings
        self.loads: dict[str, float] = {}  # engine address -> work placed there
        self.owners: OrderedDict[int, str] = OrderedDict()  # prefix key -> its engine
        self.partitions = 0  # partitions placed so far, and their work
        self.work = 0.0
        self.split = 0  # rows placed away from their group's engine, over the job

    def sync(self, engines: Sequence[str]) -> None:
        """Make ``engines`` the directory's engines: a new one starts at the least work placed
        (so it gets work at once), a departed one's work and keys are forgotten."""
        if not engines:
            raise ValueError("prefix placement: no engines")
        start = min(self.loads.values(), default=0.0)
        self.loads = {e: self.loads.get(e, start) for e in sorted(engines)}

    def place(self, rows: Sequence[RowKeys | None]) -> Placement:
        """Place one partition's rows (None: a row without keys, of work 1) on the engines
        given to :meth:`sync`; see the module's docstring."""
        if not self.loads:
            raise ValueError("prefix placement: sync() the engines first")
        s = self.settings
        engines = list(self.loads)
        work = [1.0 if r is None else float(max(1, r.work)) for r in rows]
        self.partitions += 1
        self.work += sum(work)
        estimate = self.work / self.partitions * self.npartitions / len(engines)
        placed, split = [], 0
        rank = {e: k for k, e in enumerate(engines)}
        for r, w in zip(rows, work):
            least = min(engines, key=lambda e: (self.loads[e], rank[e]))
            choice = least
            owner, matched = self._match(r)
            if owner is not None and r is not None and matched >= s.min_share * r.prompt_tokens:
                mean_after = (sum(self.loads.values()) + w) / len(engines)
                if self.loads[owner] + w <= (1 + s.balance) * max(mean_after, estimate):
                    choice = owner
                elif owner != least:
                    split += 1
            self.loads[choice] += w
            placed.append(choice)
            if r is not None:
                self._record(r, choice)
        self.split += split
        return Placement(placed, split)

    def _match(self, r: RowKeys | None) -> tuple[str | None, int]:
        """The engine of the row's longest known prefix key and that prefix's tokens."""
        if r is None:
            return None, 0
        for key, tokens in reversed(r.keys):
            owner = self.owners.get(key)
            if owner is not None and owner in self.loads:
                return owner, tokens
        return None, 0

    def _record(self, r: RowKeys, engine: str) -> None:
        for key, _ in r.keys:
            if self.owners.get(key) not in self.loads:  # unknown, or its engine is gone
                self.owners[key] = engine
        while len(self.owners) > self.settings.max_keys:
            self.owners.popitem(last=False)

    def bound(self, max_row_work: float) -> float:
        """The most work any engine may hold under the bound: ``(1 + balance)`` times the
        mean plus one row (``max_row_work``), by the work placed so far."""
        mean = sum(self.loads.values()) / max(1, len(self.loads))
        return (1 + self.settings.balance) * mean + max_row_work
