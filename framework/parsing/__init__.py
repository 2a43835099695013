"""Chat-output parsers' interfaces: tool calls (``tool_calls``) and reasoning (``reasoning``)."""
