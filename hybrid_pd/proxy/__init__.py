"""OpenAI-compatible front door and the clients it uses to reach workers."""
