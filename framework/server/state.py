"""What every route needs, kept on ``app.state.server``."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from framework.config.loader import public_config
from framework.config.schema import PlugserveConfig
from framework.server.errors import APIError
from framework.server.http_utils import BodyLimits
from framework.server.image_inputs import ImageFrontend
from framework.server.metrics import ServerMetrics
from framework.server.openai_format import TokenText
from framework.server.request_builder import RequestBuilder
from framework.server.tokenizer_manager import TokenizerManager


def served_model_name(settings: PlugserveConfig) -> str:
    """``model.served_model_name``, else the model directory's name (as vLLM and SGLang do)."""
    if settings.model.served_model_name:
        return settings.model.served_model_name
    return os.path.basename(os.path.normpath(os.fspath(settings.model.path)))


@dataclass
class ServerState:
    """The resolved config, the tokenizer manager, the request builder and the metrics."""

    cfg: DictConfig
    settings: PlugserveConfig
    tokenizer: Any
    manager: TokenizerManager
    builder: RequestBuilder
    metrics: ServerMetrics
    model_info: dict[str, Any]
    token_text: TokenText
    model_name: str
    started: float = field(default_factory=time.time)
    tool_parser: Any = None
    """``server.tool_call_parser`` (a :class:`~framework.parsing.tool_calls.ToolParser`) or None."""
    reasoning_parser: Any = None
    """``server.reasoning_parser`` (a :class:`~framework.parsing.reasoning.ReasoningParser`) or None."""
    images: ImageFrontend | None = None
    """Image inputs: the model's multimodal processor and the image limits (None: no images)."""
    http_stack: dict[str, str] = field(default_factory=dict)
    """The event loop and HTTP protocol serving (``server.event_loop`` and ``server.http_parser``
    as resolved), reported by /server_info."""

    def require_images(self, param: str) -> ImageFrontend:
        """The image front end, or a 400 naming ``param`` when the model takes no images."""
        if self.images is None:
            raise APIError(400, "this server takes no images", param=param, code="images_not_supported")
        self.images.require(param)
        return self.images

    @property
    def api_key(self) -> str | None:
        return self.settings.server.api_key

    @property
    def admin_key(self) -> str | None:
        """The key of /flush_cache and /abort_request: admin_key, else api_key."""
        return self.settings.server.admin_key or self.settings.server.api_key

    @property
    def body_limits(self) -> BodyLimits:
        return BodyLimits(self.settings.server.max_body_bytes, self.settings.server.max_json_depth)

    def model_card(self) -> dict[str, Any]:
        """The served model as ``/v1/models`` lists it: OpenAI's card plus vLLM's ``root`` and
        ``max_model_len``."""
        return {"id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "plugserve",
                "root": self.model_info.get("model_path"), "max_model_len": self.builder.context_len}

    def serves(self, name: str) -> bool:
        """True for the served model name and for the model's path: OpenAI clients, and SGLang's
        and vLLM's benchmark clients, send the path they launched the server with by default."""
        if name == self.model_name:
            return True
        paths = {os.fspath(self.settings.model.path), str(self.model_info.get("model_path") or "")}
        return bool(name) and os.path.normpath(name) in {os.path.normpath(p) for p in paths if p}

    def check_model(self, name: str) -> None:
        """404 in OpenAI's shape unless this server serves ``name``."""
        if not self.serves(name):
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    def require_tokenizer(self, param: str, what: str) -> None:
        """400 naming ``param`` when the server runs without a tokenizer (``model.skip_tokenizer_init``)
        and the request needs one for ``what``."""
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer, and this server runs without one "
                           "(model.skip_tokenizer_init=true): send token ids and read output ids",
                           param=param, code="no_tokenizer")

    def public_config(self) -> dict[str, Any]:
        """The resolved config with the keys redacted."""
        return public_config(self.cfg)
