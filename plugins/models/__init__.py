"""Built-in model plugins, registered by Hugging Face architecture name.

Every factory is the model class itself: ``cls(hf_config, options) -> nn.Module``. None of them
takes options yet, so each registers ``config=None``.
"""

from __future__ import annotations

from framework.hookspecs import Register, hookimpl
from plugins.models.llama import LlamaForCausalLM, MistralForCausalLM
from plugins.models.qwen2 import Qwen2ForCausalLM
from plugins.models.qwen3 import Qwen3ForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


@hookimpl
def register_models(register: Register) -> None:
    """Register the Llama, Mistral, Qwen2 and Qwen3 causal LMs."""
    for name, cls in MODELS.items():
        register(name, cls, config=None)
