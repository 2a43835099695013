"""``plugserve router``: pairs a prefill and a decode server per request (PD disaggregation)."""
