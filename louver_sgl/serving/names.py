"""The name the backend is registered under in SGLang."""

BACKEND_NAME = "louver"
