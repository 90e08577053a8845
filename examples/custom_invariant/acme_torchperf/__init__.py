"""ACME's performance invariants for pytest-torchperf."""
