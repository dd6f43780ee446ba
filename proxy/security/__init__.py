"""Security of the proxy: client API keys, limits, control-plane and worker credentials."""
