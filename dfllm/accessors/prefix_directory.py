"""Which engine each row of a job goes to: where its prefix is cached, within a balance bound.

A :class:`PrefixDirectory` is one job's placement state: the engines (Dask worker
addresses), the work placed on each so far, and which engines hold each known prefix key (a
row's keys are its prompt's prefix-cache block hashes at a few depths and a key of its whole
prompt, see :mod:`dfllm.tasks.prefix_keys`). :meth:`PrefixDirectory.place` places one
partition's rows, in row order.

**Cost.** A row costs an engine the tokens it computes there: its prompt tokens beyond the
longest prefix that engine already holds (when that prefix covers at least ``min_share`` of
the prompt), plus the tokens it may generate. So the rows of a group (rows sharing a
prefix) are cheap where the group's prefix is, and a row identical to one placed before
costs only its generation.

**Choice.** A row goes to its cheapest engine (ties: the least loaded, then the
lowest-numbered), unless that engine's work would then exceed ``(1 + balance)`` times the
mean (the larger of the mean after this row and the job's estimated mean: the mean cost of
the rows placed so far, times the job's estimated rows, over the engines): then it goes to
the engine whose work after the row is least, and if that engine holds less of the row's
prefix, the placement counts the row as *split* off its group (:attr:`Placement.split`).
The engine a row goes to holds its keys from then on (a split group has two engines).

**The bound.** Every engine's work stays within ``(1 + balance)`` times the job's mean plus
one row's work, as long as the estimate does not overshoot the final mean; on a job without
shared prefixes every row goes to the least loaded engine, and the engines' work is within
one row of each other. The directory keeps at most ``max_keys`` keys (the least recently
used are dropped: an engine's prefix cache does not keep its oldest prefixes either).

Pure Python (no Dask), and plain data: :meth:`PrefixDirectory.to_json` and
:meth:`PrefixDirectory.from_json` carry it through the Dask scheduler's metadata, where
:mod:`dfllm.accessors.prefix_placement` keeps a job's directory between its partitions.
"""

from __future__ import annotations

import json
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
    ``split`` counts its rows placed away from their group's engines to keep the balance."""

    engines: list[str]
    split: int


class PrefixDirectory:
    """One job's placement state (see the module's docstring)."""

    def __init__(self, npartitions: int, settings: PlacementSettings = PlacementSettings()):
        self.npartitions = max(1, int(npartitions))
        self.settings = settings
        self.loads: dict[str, float] = {}  # engine address -> the cost of the rows placed there
        self.holders: OrderedDict[int, list[str]] = OrderedDict()  # prefix key -> engines holding it
        self.partitions = 0  # partitions placed so far, their rows and those rows' cost
        self.rows = 0
        self.cost = 0.0
        self.split = 0  # rows placed away from their group's engines, over the job

    # ---- plain data, for the scheduler's metadata -----------------------------------------------
    def to_json(self) -> str:
        """The directory's state as JSON (its settings and partitions are the job's)."""
        return json.dumps(
            {
                "loads": self.loads,
                "holders": [[k, v] for k, v in self.holders.items()],
                "partitions": self.partitions,
                "rows": self.rows,
                "cost": self.cost,
                "split": self.split,
            }
        )

    @classmethod
    def from_json(cls, text: str, npartitions: int, settings: PlacementSettings) -> PrefixDirectory:
        """A directory from :meth:`to_json`'s text, for a job of ``npartitions`` with ``settings``."""
        state = json.loads(text)
        d = cls(npartitions, settings)
        d.loads = {str(e): float(w) for e, w in state["loads"].items()}
        d.holders = OrderedDict((int(k), [str(e) for e in v]) for k, v in state["holders"])
        d.partitions, d.rows = int(state["partitions"]), int(state["rows"])
        d.cost, d.split = float(state["cost"]), int(state["split"])
        return d

    # ---- placing ---------------------------------------------------------------------------------
    def sync(self, engines: Sequence[str]) -> None:
        """Make ``engines`` the directory's engines: a new one starts at the least work placed
        (so it gets work at once), a departed one's work and keys are forgotten."""
        if not engines:
            raise ValueError("prefix placement: no engines")
        start = min(self.loads.values(), default=0.0)
        self.loads = {e: self.loads.get(e, start) for e in sorted(engines)}
        for key, held in list(self.holders.items()):
            kept = [e for e in held if e in self.loads]
            if kept:
                self.holders[key] = kept
            else:
                del self.holders[key]

    def place(self, rows: Sequence[RowKeys | None]) -> Placement:
        """Place one partition's rows (None: a row without keys, of work 1) on the engines
        given to :meth:`sync`; see the module's docstring."""
        if not self.loads:
            raise ValueError("prefix placement: sync() the engines first")
        s = self.settings
        engines = list(self.loads)
        rank = {e: k for k, e in enumerate(engines)}
        self.partitions += 1
        expected_rows = (self.rows + len(rows)) / self.partitions * self.npartitions
        placed, split = [], 0
        for r in rows:
            work = 1.0 if r is None else float(max(1, r.work))
            held = self._held(r, engines)
            cost = {e: max(1.0, work - held[e]) for e in engines}
            best = min(engines, key=lambda e: (cost[e], self.loads[e], rank[e]))
            mean_cost = (self.cost + cost[best]) / (self.rows + 1)
            estimate = mean_cost * expected_rows / len(engines)
            mean_after = (sum(self.loads.values()) + cost[best]) / len(engines)
            choice = best
            if self.loads[best] + cost[best] > (1 + s.balance) * max(mean_after, estimate):
                choice = min(engines, key=lambda e: (self.loads[e] + cost[e], rank[e]))
                if held[choice] < held[best]:
                    split += 1
            self.loads[choice] += cost[choice]
            self.rows += 1
            self.cost += cost[choice]
            placed.append(choice)
            if r is not None:
                self._record(r, choice)
        self.split += split
        return Placement(placed, split)

    def _held(self, r: RowKeys | None, engines: list[str]) -> dict[str, int]:
        """Per engine, the prompt tokens of the row's longest prefix it holds (0 below ``min_share``)."""
        held = dict.fromkeys(engines, 0)
        if r is None:
            return held
        floor = self.settings.min_share * r.prompt_tokens
        for key, tokens in r.keys:  # shortest first: a longer prefix overwrites a shorter one
            if tokens >= floor:
                for e in self.holders.get(key, ()):
                    if e in held:
                        held[e] = tokens
        return held

    def _record(self, r: RowKeys, engine: str) -> None:
        for key, _ in r.keys:
            held = self.holders.get(key)
            if held is None:
                self.holders[key] = [engine]
            else:
                if engine not in held:
                    held.append(engine)
                self.holders.move_to_end(key)
        while len(self.holders) > self.settings.max_keys:
            self.holders.popitem(last=False)

    def bound(self, max_row_work: float) -> float:
        """The most work any engine may hold under the bound: ``(1 + balance)`` times the
        mean plus one row (``max_row_work``), by the work placed so far."""
        mean = sum(self.loads.values()) / max(1, len(self.loads))
        return (1 + self.settings.balance) * mean + max_row_work
