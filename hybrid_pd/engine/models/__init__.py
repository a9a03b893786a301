"""Model architectures (pure PyTorch, device-agnostic) and their registry."""
