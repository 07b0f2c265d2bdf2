"""dfllm: dataframe-native batch LLM inference on its own paged-KV engine.

The package root is lazy, as vLLM's is: each public name is imported on first use, so that
``from dfllm import LLM`` (or ``import dfllm.engine.scheduler``) loads the engine and not the
dataframe stack (Dask, distributed, Polars, the accessors, the jobs).

``.llm`` is put on each dataframe library that is installed, whichever is imported first
(:mod:`dfllm.namespaces`). A public name that needs a package which is not installed raises
an ImportError naming the package and its ``pip install`` command.
"""

from __future__ import annotations

import importlib
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from dfllm import namespaces
from dfllm.namespaces import missing_package

if TYPE_CHECKING:  # what the names are, for type checkers; at run time __getattr__ imports them
    from dfllm.accessors.writer import WriteSummary, write_parquet
    from dfllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from dfllm.errors import InvalidRequestError, VLLMValidationError
    from dfllm.jobs.batch_job import BatchSummary, run_batch
    from dfllm.jobs.processor import Processor, build_llm_processor, build_processor
    from dfllm.jobs.ray_config import (
        ChatTemplateStageConfig,
        DetokenizeStageConfig,
        PrepareImageStageConfig,
        PrepareMultimodalStageConfig,
        ProcessorConfig,
        TokenizerStageConfig,
        vLLMEngineProcessorConfig,
    )
    from dfllm.llm import LLM
    from dfllm.lora.request import LoRARequest
    from dfllm.outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        Logprob,
        PoolingOutput,
        PoolingRequestOutput,
        RequestFailedError,
        RequestMetrics,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from dfllm.pooling_params import PoolingParams
    from dfllm.sampling_params import SamplingParams
    from dfllm.semantic.cascade import Cascade, CascadeStats
    from dfllm.structured_outputs import StructuredOutputsParams
    from dfllm.tasks.response_cache import ResponseCache
    from dfllm.worker.engine_cache import release_engines

__all__ = [
    "LLM",
    "SamplingParams",
    "PoolingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "write_parquet",
    "WriteSummary",
    "ProcessorConfig",
    "Processor",
    "build_processor",
    "StructuredOutputsParams",
    "RequestFailedError",
    "release_engines",
    "vLLMEngineProcessorConfig",
    "build_llm_processor",
    "InvalidRequestError",
    "VLLMValidationError",
    "ChatTemplateStageConfig",
    "TokenizerStageConfig",
    "DetokenizeStageConfig",
    "PrepareMultimodalStageConfig",
    "PrepareImageStageConfig",
    "run_batch",
    "BatchSummary",
    "ResponseCache",
    "Cascade",
    "CascadeStats",
    "LoRARequest",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
__version__ = version("dfllm")  # pyproject.toml's

#: The module each public name is imported from, on first use.
_MODULES: dict[str, str] = {
    "Cascade": "dfllm.semantic.cascade",
    "CascadeStats": "dfllm.semantic.cascade",
    "WriteSummary": "dfllm.accessors.writer",
    "write_parquet": "dfllm.accessors.writer",
    **dict.fromkeys(("BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence"), "dfllm.beam_search"),
    "InvalidRequestError": "dfllm.errors",
    "VLLMValidationError": "dfllm.errors",
    "BatchSummary": "dfllm.jobs.batch_job",
    "run_batch": "dfllm.jobs.batch_job",
    "Processor": "dfllm.jobs.processor",
    "build_llm_processor": "dfllm.jobs.processor",
    "build_processor": "dfllm.jobs.processor",
    "ChatTemplateStageConfig": "dfllm.jobs.ray_config",
    "DetokenizeStageConfig": "dfllm.jobs.ray_config",
    "PrepareImageStageConfig": "dfllm.jobs.ray_config",
    "PrepareMultimodalStageConfig": "dfllm.jobs.ray_config",
    "ProcessorConfig": "dfllm.jobs.ray_config",
    "TokenizerStageConfig": "dfllm.jobs.ray_config",
    "vLLMEngineProcessorConfig": "dfllm.jobs.ray_config",
    "LLM": "dfllm.llm",
    "LoRARequest": "dfllm.lora.request",
    **dict.fromkeys(
        (
            "ClassificationOutput",
            "ClassificationRequestOutput",
            "CompletionOutput",
            "EmbeddingOutput",
            "EmbeddingRequestOutput",
            "Logprob",
            "PoolingOutput",
            "PoolingRequestOutput",
            "RequestFailedError",
            "RequestMetrics",
            "RequestOutput",
            "ScoringOutput",
            "ScoringRequestOutput",
        ),
        "dfllm.outputs",
    ),
    "PoolingParams": "dfllm.pooling_params",
    "SamplingParams": "dfllm.sampling_params",
    "StructuredOutputsParams": "dfllm.structured_outputs",
    "ResponseCache": "dfllm.tasks.response_cache",
    "release_engines": "dfllm.worker.engine_cache",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'dfllm' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise missing_package(exc, f"dfllm.{name}") from exc
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


namespaces.watch_libraries()
