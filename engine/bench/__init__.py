"""The benchmark and the concurrency benchmark."""
