"""The `dcoco-hf` command line and its benchmarks (`generate`, `bench`, `bench-batch`, `export`)."""
