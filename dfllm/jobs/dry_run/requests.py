"""What turns a partition's rows into the engine requests a dry run surveys: the
:class:`RequestSource` protocol, an ``.llm`` task's (:class:`TaskRequests`, its own runner
stopped before it would generate), and the response cache's lookup by name."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import pandas as pd

from dfllm.tasks.schema import LLM_ERROR

if TYPE_CHECKING:
    from dfllm.config import EngineConfig
    from dfllm.engine.input_processor import EngineRequest, InputProcessor
    from dfllm.tasks.task import LLMTask


class RequestSource(Protocol):
    """What a dry run asks of a job's rows: the engine they run on (``model``,
    ``engine_kwargs`` as sorted ``(name, value)`` pairs), the checked requests a partition
    becomes, and which of them a response cache answers. Picklable (it travels to the workers)."""

    @property
    def model(self) -> str | None:
        """The model (a directory or bundled alias; None: the default)."""
        ...

    @property
    def engine_kwargs(self) -> tuple:
        """``LLM(...)``'s keyword arguments as sorted ``(name, value)`` pairs."""
        ...

    def requests(
        self, df: pd.DataFrame, processor: InputProcessor, lock: threading.Lock
    ) -> tuple[list[EngineRequest], dict[int, str]] | tuple[list[EngineRequest], dict[int, str], dict[int, str]]:
        """The requests the real run would hand to the engine for ``df``'s rows, one per row
        not refused, in row order; and the refused rows: row position -> the message its
        ``llm_error`` would hold. Call ``processor`` holding ``lock``. A source whose rows do
        not all run on this engine adds a third item, the rows the dry run does not estimate:
        row position -> why (rows neither run here nor refused). A source whose ``requests``
        takes ``check_lora=`` gets the engine's check of a LoRA adapter (see
        :func:`source_requests`)."""
        ...

    def cache_hits(self, requests: list[EngineRequest], config: EngineConfig) -> list[bool] | None:
        """For each request, whether the job's response cache holds its answer (None: no cache)."""
        ...


def _no_generation(requests: list[EngineRequest]) -> list:
    raise AssertionError("a dry run's runner collects its requests; it never generates")


@dataclasses.dataclass(frozen=True)
class TaskRequests:
    """The requests of a generate or chat :class:`~dfllm.tasks.task.LLMTask`: its own
    runner (:mod:`dfllm.tasks.runners`) builds them, so rows are read, rendered, checked
    exactly as in the real run; the runner stops where it would generate. Requests stay in
    row order (a task's ``sort_by`` changes the engine's order, not what it computes), and
    bad rows are collected whatever the task's ``on_error`` (the dry run lists them all)."""

    task: LLMTask

    def __post_init__(self) -> None:
        if not self.task.spec.generative:
            raise ValueError(
                f"dry run: the task is {self.task.kind}; a dry run checks generate and chat jobs "
                "(their prompts, tokens and time)"
            )

    @property
    def model(self) -> str | None:
        return self.task.model

    @property
    def engine_kwargs(self) -> tuple:
        return self.task.engine_kwargs

    def requests(
        self,
        df: pd.DataFrame,
        processor: InputProcessor,
        lock: threading.Lock,
        check_lora: Callable[[Any], None] | None = None,
    ) -> tuple[list[EngineRequest], dict[int, str]]:
        """As :meth:`RequestSource.requests`; ``check_lora`` is the engine's check of a LoRA
        adapter (:meth:`~dfllm.engine.llm_engine.LLMEngine.check_lora`), the one the real run
        calls on each row's adapter, so that a row whose adapter cannot run is refused here too."""
        from dfllm.tasks.runners import RUNNERS, Generation

        fields: dict[str, Any] = {"on_error": "null", "sort_by": ()}
        if getattr(self.task, "cache", None) is not None:
            fields["cache"] = None  # every accepted request reaches the capture; hits are counted apart
        task = dataclasses.replace(self.task, **fields)
        out: dict[str, list] = {c: [None] * len(df) for c in task.output_dtypes()}
        collected: dict[int, EngineRequest] = {}  # the runner stops before generating and leaves them here
        gen = Generation(processor, lock, _no_generation, check_lora=check_lora, collect=collected)
        RUNNERS[task.spec.runner](df, task, out, gen)
        requests = [collected[i] for i in sorted(collected)]
        return requests, {i: e for i, e in enumerate(out[LLM_ERROR]) if e is not None}

    def cache_hits(self, requests: list[EngineRequest], config: EngineConfig) -> list[bool] | None:
        cache = getattr(self.task, "cache", None)
        if cache is None:
            return None
        return cached_requests(cache, config, self.task.engine_kwargs, requests)


def cached_requests(cache, config: EngineConfig, engine_kwargs: tuple, requests: list[EngineRequest]) -> list[bool]:
    """For each request, whether ``cache`` (a response cache) holds an entry for it, looked up
    by name only (nothing is read, refreshed or written)."""
    from concurrent.futures import ThreadPoolExecutor

    import fsspec

    from dfllm.tasks.response_cache import engine_identity, request_key

    engine = engine_identity(config, engine_kwargs)
    keys = [None if engine is None else request_key(engine, r) for r in requests]
    fs = fsspec.core.url_to_fs(cache.url, **dict(cache.storage_options or {}))[0]

    def present(key: str | None) -> bool:
        if key is None:
            return False
        try:
            return bool(fs.exists(cache.path_of(key)))
        except OSError:
            return False

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(present, keys))
