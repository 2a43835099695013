"""Built-in chat-output parsers: tool-call formats and reasoning markers (one entry point each)."""
