"""Running workers: the worker loop, processes, start-up, stopping, telemetry."""
