"""Token budgets of a write: :class:`Budget` (``write_parquet(..., budget=...)``, ``dfllm run
--max-prompt-tokens/--max-generated-tokens``) and the :class:`Gate` its partitions pass.

A budget counts the prompt and generated tokens of the partitions a write computes (parts
kept or copied from an earlier write cost nothing and count nothing): each partition adds
its own to the write's totals as it finishes, before its task returns. Once a total reaches
its bound, no new partition starts: the gate closes (a partition task that starts after
that returns without computing or writing anything, not even on the thread the last one
ran on), the write's futures that have not started yet are cancelled, and the partitions
already running finish and are written. So the budget may be passed by what those partitions use, never by
a partition started after it was reached. (On a Dask worker, "running" can be more partitions than
the worker has threads: while their rows fit in one batch of its engine, see
:mod:`dfllm.worker.driver`.) The folder then holds the finished parts exactly
as written, and ``write_parquet(..., resume=True)`` (``dfllm run --resume``) computes the
rest (see :mod:`dfllm.accessors.writer`).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

_local: dict[str, _LocalState] = {}  # gates of writes without a distributed client, by name


@dataclass(frozen=True)
class Budget:
    """Bounds on the tokens one write may use: ``prompt_tokens`` (the prompts of the rows it
    computes) and ``generated_tokens`` (what the model generates for them); None is no bound.
    ``ValueError`` naming the field for a bound that is not a positive integer."""

    prompt_tokens: int | None = None
    generated_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "generated_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"budget: {name} must be a positive integer or None, got {value!r}")

    def __bool__(self) -> bool:
        return self.prompt_tokens is not None or self.generated_tokens is not None

    def reached(self, prompt_tokens: int, generated_tokens: int) -> str | None:
        """Why the budget is spent at these totals (a sentence naming the bound), or None."""
        if self.prompt_tokens is not None and prompt_tokens >= self.prompt_tokens:
            return (
                f"the prompt token budget ({self.prompt_tokens}) was reached: {prompt_tokens} prompt tokens "
                "in the partitions computed"
            )
        if self.generated_tokens is not None and generated_tokens >= self.generated_tokens:
            return (
                f"the generated token budget ({self.generated_tokens}) was reached: {generated_tokens} tokens "
                "generated in the partitions computed"
            )
        return None


class Gate:
    """A write's budget as its partitions see it: each computed partition adds its tokens
    (:meth:`spend`) before it returns, and the gate closes as soon as they reach the budget,
    so a partition that starts after that sees it closed (:meth:`closed`) and does nothing.
    Picklable. On a distributed cluster its state lives on the scheduler (an ``Event`` that
    is set once closed, and the running totals in a ``Variable`` updated under a ``Lock``),
    so that every worker sees it; otherwise in this process."""

    def __init__(self, budget: Budget, distributed: bool, name: str | None = None):
        self.budget, self.distributed = budget, distributed
        self.name = name or f"dfllm-budget-{uuid.uuid4().hex}"
        if distributed:
            from distributed import Variable

            Variable(f"{self.name}-spent").set([0, 0])
        else:
            _local.setdefault(self.name, _LocalState())

    def closed(self) -> bool:
        """Whether the budget was reached (no new partition may start)."""
        if not self.distributed:
            return _local.setdefault(self.name, _LocalState()).event.is_set()
        from distributed import Event

        return bool(Event(self.name).is_set())

    def spend(self, prompt_tokens: int, generated_tokens: int) -> None:
        """Add a computed partition's tokens to the write's totals; close the gate if they
        reach the budget."""
        if not self.distributed:
            state = _local.setdefault(self.name, _LocalState())
            with state.lock:
                state.spent[0] += prompt_tokens
                state.spent[1] += generated_tokens
                if self.budget.reached(*state.spent):
                    state.event.set()
            return
        from distributed import Event, Lock, Variable

        with Lock(f"{self.name}-lock"):
            variable = Variable(f"{self.name}-spent")
            prompt, generated = variable.get()
            spent = [prompt + prompt_tokens, generated + generated_tokens]
            variable.set(spent)
        if self.budget.reached(*spent):
            Event(self.name).set()

    def spent(self) -> tuple[int, int]:
        """The prompt and generated tokens of the partitions computed so far."""
        if not self.distributed:
            state = _local.setdefault(self.name, _LocalState())
            with state.lock:
                return state.spent[0], state.spent[1]
        from distributed import Variable

        prompt, generated = Variable(f"{self.name}-spent").get()
        return int(prompt), int(generated)

    def forget(self) -> None:
        """Drop the gate's state (on the scheduler, or in this process) once the write is over."""
        if not self.distributed:
            _local.pop(self.name, None)
            return
        try:
            from distributed import Event, Variable

            Event(self.name).clear()  # a cleared event without waiters is deleted on the scheduler
            Variable(f"{self.name}-spent").delete()
        except Exception:  # noqa: BLE001 (the cluster may be gone; nothing to clean then)
            pass


class _LocalState:
    """A gate's state in this process (writes without a distributed client)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.event = threading.Event()
        self.spent = [0, 0]
