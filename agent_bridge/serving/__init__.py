"""The server beneath the APIs: the bridge to the engine thread, job streams, the model registry,
the request guard, error handlers, its own routes (/health, /metrics, /machine, /v1/corpus),
metrics and telemetry."""
