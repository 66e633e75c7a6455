"""The gateway: OpenAI-compatible HTTP and gRPC front door with continuous batching."""
