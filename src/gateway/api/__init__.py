"""The gateway's client-facing APIs: OpenAI-compatible HTTP and gRPC, their request models and validation."""
