"""A step's integer inputs, gathered on the host and sent to the device in one copy per dtype.

Building a step's inputs as a dozen ``torch.tensor(..., device="cuda")`` calls costs a dozen
host-to-device copies from pageable memory, each of which waits for the device to finish what
it was doing. :class:`HostPack` collects the arrays (Python lists of ints, or CPU tensors) per
dtype, concatenates them into one pinned buffer and copies it without waiting
(``non_blocking``), so the device runs the previous step's work while the host prepares this
one; each array is then a view into the device buffer. On a CPU device nothing is copied: the
views are into the host buffer.

The pinned buffers come from torch's caching host allocator, which reuses a buffer only after
the copy that reads it has completed, so a step never overwrites inputs still in flight.
"""

from __future__ import annotations

import torch


class HostPack:
    """Arrays added with :meth:`add`, then moved together by :meth:`send`."""

    def __init__(self) -> None:
        self._parts: dict[torch.dtype, list[torch.Tensor]] = {}
        self._where: list[tuple[torch.dtype, int, int, tuple[int, ...]]] = []  # dtype, start, length, shape
        self._sizes: dict[torch.dtype, int] = {}

    def add(self, values: list[int] | torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> int:
        """Add an array (flat ``values``, viewed as ``shape`` on arrival); its index in :meth:`send`'s list."""
        part = values.to(dtype).flatten() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        start = self._sizes.get(dtype, 0)
        self._parts.setdefault(dtype, []).append(part)
        self._sizes[dtype] = start + part.numel()
        self._where.append((dtype, start, part.numel(), (part.numel(),) if shape is None else shape))
        return len(self._where) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every array added, on ``device``, in the order added (views into one buffer per dtype)."""
        buffers = {}
        for dtype, parts in self._parts.items():
            host = parts[0] if len(parts) == 1 else torch.cat(parts)
            if device.type == "cuda":
                host = host.pin_memory().to(device, non_blocking=True)
            elif device.type != "cpu":
                host = host.to(device)
            buffers[dtype] = host
        return [buffers[dtype][start : start + n].view(shape) for dtype, start, n, shape in self._where]
