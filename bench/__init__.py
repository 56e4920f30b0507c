"""Benchmarks that run pdserve side by side with a peer or a limit and print the ratio."""
