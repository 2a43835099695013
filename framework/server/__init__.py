"""The HTTP server: Starlette app, tokenizer manager, scheduler process, IPC."""
