"""A step's integer inputs, gathered on the host and sent to the device in one copy per dtype.

Building a step's inputs as a dozen ``torch.tensor(..., device="cuda")`` calls costs a dozen
host-to-device copies from pageable memory, each of which waits for the device to finish what
it was doing. :class:`HostPack` collects the arrays (Python lists of ints, NumPy arrays or CPU tensors) per
dtype, concatenates them into one pinned buffer and copies it without waiting
(``non_blocking``), so the device runs the previous step's work while the host prepares this
one; each array is then a view into the device buffer. On a CPU device nothing is copied: each
array is handed back as the tensor over its own host memory.

The pinned buffers come from torch's caching host allocator, which reuses a buffer only after
the copy that reads it has completed, so a step never overwrites inputs still in flight.
"""

from __future__ import annotations

import numpy as np
import torch

# the dtypes a step's integer inputs take, and their NumPy twins (the arrays are gathered in NumPy:
# a small array costs about a microsecond there, several through torch's dispatcher)
NUMPY_DTYPES: dict[torch.dtype, type] = {torch.long: np.int64, torch.int32: np.int32}


class HostPack:
    """Arrays added with :meth:`add`, then moved together by :meth:`send`."""

    def __init__(self) -> None:
        self._where: list[tuple[torch.dtype, int, int, tuple[int, ...]]] = []  # dtype, start, length, shape
        self._sizes: dict[torch.dtype, int] = {}
        self._order: list[np.ndarray] = []  # the arrays in the order added

    def add(
        self,
        values: list[int] | np.ndarray | torch.Tensor,
        dtype: torch.dtype,
        shape: tuple[int, ...] | None = None,
    ) -> int:
        """Add an array (flat ``values``, viewed as ``shape`` on arrival; ``dtype`` is
        ``torch.long`` or ``torch.int32``); its index in :meth:`send`'s list."""
        kind = NUMPY_DTYPES[dtype]
        if isinstance(values, torch.Tensor):
            values = values.numpy(force=True)
        part: np.ndarray = np.asarray(values, dtype=kind).ravel()
        start = self._sizes.get(dtype, 0)
        self._order.append(part)
        self._sizes[dtype] = start + part.size
        self._where.append((dtype, start, part.size, (part.size,) if shape is None else shape))
        return len(self._where) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every array added, on ``device``, in the order added (on a CPU device the arrays
        themselves; elsewhere views into one buffer per dtype)."""
        if device.type == "cpu":
            return [torch.from_numpy(part.reshape(w[3])) for part, w in zip(self._order, self._where)]
        buffers = {}
        for dtype in self._sizes:
            parts = [part for part, w in zip(self._order, self._where) if w[0] == dtype]
            host = torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts))
            if device.type == "cuda":
                host = host.pin_memory().to(device, non_blocking=True)
            else:
                host = host.to(device)
            buffers[dtype] = host
        return [buffers[dtype][start : start + n].view(shape) for dtype, start, n, shape in self._where]
