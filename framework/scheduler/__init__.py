"""Continuous-batching scheduler: requests, policies, batch building, the scheduling loop."""
