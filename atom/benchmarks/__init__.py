"""Benchmarking tools for atom (online serving benchmark, adapted from vLLM's benchmarks)."""
