"""Prefill/decode disaggregation: the KV transfer plugin interface and the bootstrap service.

Module map:

- ``base``: ``TransferBackend`` (the plugin interface, sender and receiver roles), ``KVLayout``,
  ``TransferState`` and the per-request ``TransferTask`` state machine.
- ``addressing``: page addresses (base pointer + page index x bytes per page, per layer, K then V)
  and merging contiguous page runs into one transfer each.
- ``bootstrap``: the prefill side's bootstrap service (ranks register their transfer endpoints,
  decode servers post the destination pages of a room) and its JSON client.
- ``common``: building the configured transfer backend; the first-token metadata.
- ``heads``, ``links``, ``agreement``, ``decode_peer``: servers of different TP sizes: the model
  identity and each rank's KV heads, one backend per linked pair of ranks (head slices or whole
  pages), the per-step agreement between the ranks of one side, the decode side's rank 0 and the
  prefill bootstrap.
- ``prefill_side``, ``decode_side``: the two ``PDSide`` implementations
  (``framework.scheduler.pd``); ``factory.make_pd_side`` picks one for the config.
"""
