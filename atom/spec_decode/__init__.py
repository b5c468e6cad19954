"""Speculative decoding: a proposer drafts ``K`` tokens per request, one target forward
verifies them, a rejection sampler keeps the longest acceptable run (see
docs/speculative.md)."""
