"""Built-in model plugins, registered by Hugging Face architecture name.

Every factory is the model class itself: ``cls(hf_config, options) -> nn.Module``. The text models
take no options (``config=None``); the Qwen VL models take :class:`QwenVLOptions`.
"""

from __future__ import annotations

from framework.hookspecs import Register, hookimpl
from plugins.models.llama import LlamaForCausalLM, MistralForCausalLM
from plugins.models.qwen2 import Qwen2ForCausalLM
from plugins.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration, QwenVLOptions
from plugins.models.qwen3 import Qwen3ForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
VL_MODELS = {
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
}


@hookimpl
def register_models(register: Register) -> None:
    """Register the Llama, Mistral, Qwen2 and Qwen3 causal LMs and the Qwen2(.5)-VL models."""
    for name, cls in MODELS.items():
        register(name, cls, config=None)
    for name, cls in VL_MODELS.items():
        register(name, cls, config=QwenVLOptions)
