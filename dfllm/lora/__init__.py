"""LoRA adapters: many adapters served in one batch (see docs/lora.md).

:class:`LoRARequest` (vLLM's, also at ``dfllm.lora.request``) names an adapter for a
request; :mod:`dfllm.lora.adapter` reads and checks PEFT adapter folders;
:mod:`dfllm.lora.manager` keeps them in a CPU cache and in the model's ``max_loras``
slots; :mod:`dfllm.lora.layers` holds the slots in the model and applies them;
:mod:`dfllm.lora.resolve` finds the adapters dataframe rows name, on the workers.
"""

from dfllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
