"""dfllm: dataframe-native batch LLM inference on its own paged-KV engine."""

from importlib.metadata import version

from dfllm import accessors  # noqa: F401  (registers .llm on Dask, pandas and Polars)
from dfllm.accessors.semantic.cascade import Cascade, CascadeStats
from dfllm.accessors.writer import WriteSummary, write_parquet
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
]
__version__ = version("dfllm")  # pyproject.toml's
