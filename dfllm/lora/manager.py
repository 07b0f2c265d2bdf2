"""Which adapters are loaded where: a CPU cache of ``max_cpu_loras`` and ``max_loras`` slots.

Adapters are read and checked once (:func:`~dfllm.lora.adapter.load_adapter`) into a CPU
cache of at most ``max_cpu_loras`` adapters, least recently used evicted first (a pinned one
never); an evicted adapter is read again from its path when a request needs it. An id is
one adapter for good (vLLM's rule; its prefix-cache blocks are keyed by it): a request that
carries the ``identity`` of its files (a dataframe row's adapter) is only run from files that
still hold it (:func:`~dfllm.lora.adapter.load_adapter` refuses others), and changed files are
another adapter with another id (:func:`~dfllm.lora.resolve.resolve`). Before each
step the engine asks for the step's adapters (:meth:`LoRAManager.activate`): each one already
in a slot stays there, the others are copied into free slots or, least recently used first,
into slots of adapters the step does not use (a pinned adapter's slot last). The scheduler
never admits more distinct adapters into a step than there are slots, so a step always fits.

An adapter not in the CPU cache is read again when a step needs it, and its files may have
broken since its requests were checked (deleted, cut short, replaced, reshaped): then
:meth:`LoRAManager.activate` raises :class:`LoRASlotError` naming every such adapter of the
step and what is wrong with it, before it changes any slot, and the engine ends those
adapters' requests with that error and schedules the step again without them. A slot is
recorded as holding an adapter only once its weights were copied in, so a failed copy never
passes for the adapter later.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from dfllm.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from dfllm.lora.request import LoRARequest
from dfllm.models.spec import ModelSpec

SlotLoader = Callable[[int, LoRAAdapter | None], None]  # (slot, adapter or None to clear) on every rank


class LoRASlotError(LoRAAdapterError):
    """Adapters a step needs that cannot be read into slots now: ``errors`` maps each one's
    ``lora_int_id`` to its :class:`~dfllm.lora.adapter.LoRAAdapterError` (naming the adapter,
    its path and the problem). Raised before any slot changed."""

    def __init__(self, errors: dict[int, LoRAAdapterError]):
        super().__init__("; ".join(str(e) for e in errors.values()))
        self.errors = errors


def _holding(request: LoRARequest) -> str:
    return "" if request.identity is None else f" (files {request.identity[:16]})"


class LoRAManager:
    """The adapters of one engine: registered, cached on the CPU, and in the model's slots."""

    def __init__(
        self,
        spec: ModelSpec,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        load_slot: SlotLoader,
        supported_modules: set[str],
        dtype: torch.dtype = torch.float32,
    ):
        self.spec, self.max_loras, self.max_lora_rank = spec, max_loras, max_lora_rank
        self.dtype = dtype  # the model's: adapters whose weights overflow it are refused
        self.max_cpu_loras = max_cpu_loras
        self.load_slot = load_slot
        self.supported_modules = supported_modules
        self.known: dict[int, LoRARequest] = {}  # every adapter seen, by lora_int_id
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.pinned: set[int] = set()
        self.slots: list[int | None] = [None] * max_loras
        self.slot_use: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # LRU first
        self.loads = 0  # adapters copied into slots (for tests and metrics)

    # ---- vLLM's add_lora / remove_lora / list_loras / pin_lora ---------------------------------
    def add_lora(self, request: LoRARequest) -> bool:
        """Read and check the adapter (:class:`~dfllm.lora.adapter.LoRAAdapterError` naming
        the problem) into the CPU cache; True (also when it was there already)."""
        self.adapter(request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (not while requests use it: the engine checks); whether it was known."""
        known = self.known.pop(lora_id, None) is not None
        self.cpu.pop(lora_id, None)
        self.pinned.discard(lora_id)
        for slot, held in enumerate(self.slots):
            if held == lora_id:
                self.slots[slot] = None
                self.load_slot(slot, None)
        return known

    def list_loras(self) -> set[int]:
        """The ids of the adapters in the CPU cache."""
        return set(self.cpu)

    def pin_lora(self, lora_id: int) -> bool:
        """Keep an adapter in the CPU cache for good (and in its slot as long as possible)."""
        if lora_id not in self.cpu:
            raise ValueError(f"pin_lora: no adapter with lora_int_id={lora_id} is loaded (add_lora it first)")
        if lora_id not in self.pinned and len(self.pinned) >= self.max_cpu_loras:
            raise ValueError(
                f"pin_lora: {len(self.pinned)} adapters are pinned already, as many as "
                f"max_cpu_loras={self.max_cpu_loras}"
            )
        self.pinned.add(lora_id)
        return True

    # ---- the CPU cache ---------------------------------------------------------------------
    def check(self, request: LoRARequest) -> None:
        """Raise :class:`~dfllm.lora.adapter.LoRAAdapterError` unless ``request`` can run
        (its adapter read and checked, and cached)."""
        self.adapter(request)

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The checked adapter of ``request``, from the CPU cache or read now."""
        if not isinstance(request, LoRARequest):
            raise LoRAAdapterError(
                f"lora_request must be a LoRARequest (lora_name, lora_int_id, lora_path), got {type(request).__name__}"
            )
        lid = request.lora_int_id
        known = self.known.get(lid)
        if known is not None and (known.lora_path, known.lora_name, known.identity) != (
            request.lora_path,
            request.lora_name,
            request.identity,
        ):
            raise LoRAAdapterError(
                f"lora_int_id={lid} is already used by adapter {known.lora_name!r} at "
                f"{known.lora_path!r}{_holding(known)}; adapter {request.lora_name!r} at "
                f"{request.lora_path!r}{_holding(request)} needs another id"
            )
        cached = self.cpu.get(lid)
        if cached is not None:
            self.cpu.move_to_end(lid)
            return cached
        adapter = load_adapter(request, self.spec, self.max_lora_rank, self.dtype)
        missing = sorted(adapter.modules - self.supported_modules)
        if missing:
            raise LoRAAdapterError(
                f"LoRA adapter {request.lora_name!r} (path {request.lora_path!r}) targets "
                f"{missing}, modules this model's layers do not have as LoRA targets "
                f"(supported: {sorted(self.supported_modules)})"
            )
        while len(self.cpu) >= self.max_cpu_loras:
            victim = next((i for i in self.cpu if i not in self.pinned), None)
            if victim is None:
                raise LoRAAdapterError(
                    f"cannot load LoRA adapter {request.lora_name!r}: the CPU cache holds "
                    f"max_cpu_loras={self.max_cpu_loras} pinned adapters"
                )
            del self.cpu[victim]
        self.known[lid] = request
        self.cpu[lid] = adapter
        return adapter

    # ---- the slots -----------------------------------------------------------------------
    def activate(self, requests: dict[int, LoRARequest]) -> dict[int, int]:
        """Put the adapters of one step (by id, at most ``max_loras``) into slots; their slots.

        Every adapter not in a slot is read (or taken from the CPU cache) first: if any cannot
        be, :class:`LoRASlotError` names them all and no slot has changed."""
        if len(requests) > self.max_loras:
            raise RuntimeError(f"a step runs {len(requests)} LoRA adapters, more than max_loras={self.max_loras}")
        where = {lid: s for s, lid in enumerate(self.slots) if lid is not None}
        # the adapters themselves, held here: reading one may evict another from the CPU cache
        wanted: dict[int, LoRAAdapter] = {}
        errors: dict[int, LoRAAdapterError] = {}
        for lid, request in requests.items():
            if lid not in where:
                try:
                    wanted[lid] = self.adapter(request)
                except LoRAAdapterError as exc:
                    errors[lid] = exc
        if errors:
            raise LoRASlotError(errors)
        out = {lid: where[lid] for lid in requests if lid in where}
        for lid, adapter in wanted.items():
            slot = self._free_slot(set(requests))
            self.slots[slot] = None  # until the copy is done: a failed one holds no adapter
            self.load_slot(slot, adapter)
            self.slots[slot] = lid
            self.loads += 1
            out[lid] = slot
        for slot in out.values():
            self.slot_use.move_to_end(slot)
        return out

    def _free_slot(self, needed: set[int]) -> int:
        """An empty slot, else the least recently used slot whose adapter is not ``needed``
        (a pinned adapter's last)."""
        for slot, lid in enumerate(self.slots):
            if lid is None:
                return slot
        candidates = [s for s in self.slot_use if self.slots[s] not in needed]
        unpinned = [s for s in candidates if self.slots[s] not in self.pinned]
        return (unpinned or candidates)[0]

    def reset_slots(self) -> None:
        """Forget what the slots hold (after the model's buffers were rebuilt)."""
        self.slots = [None] * self.max_loras
