"""Prefill/decode disaggregation: the KV transfer plugin interface and the bootstrap service.

Module map:

- ``base``: ``TransferBackend`` (the plugin interface, sender and receiver roles), ``KVLayout``,
  ``TransferState`` and the per-request ``TransferTask`` state machine.
- ``addressing``: page addresses (base pointer + page index x bytes per page, per layer, K then V)
  and merging contiguous page runs into one transfer each.
- ``bootstrap``: the prefill side's bootstrap service (ranks register their transfer endpoints,
  decode servers post the destination pages of a room) and its JSON client.
- ``common``: building the configured transfer backend; the first-token metadata.
- ``prefill_side``, ``decode_side``: the two ``PDSide`` implementations
  (``framework.scheduler.pd``); ``factory.make_pd_side`` picks one for the config.
"""
