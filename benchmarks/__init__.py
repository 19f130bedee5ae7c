"""One-command benchmarks; each prints ours vs the reference measured side by side."""
