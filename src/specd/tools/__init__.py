"""Tools around the services (benchmark, trace summaries); the services never import this package."""
