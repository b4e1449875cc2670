"""SGLang integration of louver: plugin entry point, backend, options, telemetry."""
