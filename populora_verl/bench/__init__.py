"""Benchmarks: ``python -m populora_verl.bench.<name>`` (operators, ...)."""
