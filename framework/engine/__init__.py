"""The in-process front end: the ``Engine`` facade and the client-side request state it shares
with the HTTP server (detokenization, stop strings, meta info)."""
