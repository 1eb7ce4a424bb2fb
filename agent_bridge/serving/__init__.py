"""The bridge to the engine thread: job streams, the model registry, metrics, telemetry."""
