"""Draft and verify: one loop for every drafter, and verify forwards batched across sequences."""
