"""What the GPU check ran on, as JSON: Python, torch, Triton, transformers, the GPU(s) and the host CPU.

    python benchmarks/gpu/environment.py OUT.json {cuda,cpu}

Exits 1 when ``cuda`` is asked for and torch sees no CUDA device, or dfllm's engine does not import.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import sys


def version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    out, device = sys.argv[1], sys.argv[2]
    import torch

    cuda = torch.cuda.is_available()
    errors = []
    if device == "cuda" and not cuda:
        errors.append(f"torch {torch.__version__} sees no CUDA device")
    try:
        from dfllm import LLM  # noqa: F401  (the engine imports without the dataframe stack)
    except Exception as exc:  # noqa: BLE001  (recorded, the check then fails)
        errors.append(f"from dfllm import LLM failed: {exc!r}")
    info = {
        "python": sys.version.split()[0],
        **{name: version(name) for name in ("torch", "triton", "transformers", "dfllm", "xgrammar", "dask")},
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "cpu": cpu_model(),
        "dask_loaded_by_engine": "dask" in sys.modules,
        "errors": errors,
    }
    json.dump(info, open(out, "w"), indent=2)
    print(json.dumps(info))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
