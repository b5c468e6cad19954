"""Evaluations: how correct atom is (lm-eval accuracy), where ``atom.benchmarks`` measures how fast it is."""
