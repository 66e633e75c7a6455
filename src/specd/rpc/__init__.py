"""gRPC plumbing the services share: serving, backend auth, TLS, leases, health and tracing."""
