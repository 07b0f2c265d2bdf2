"""dfllm: dataframe-native batch LLM inference on its own paged-KV engine."""

from dfllm.llm import LLM
from dfllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from dfllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics"]
__version__ = "0.1.0"
