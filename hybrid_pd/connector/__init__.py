"""KV connector: SupportsHMA roles, gRPC control plane, UCX data plane."""
