"""Tests of sampling parameters, the batched sampler and the detokenizer."""
