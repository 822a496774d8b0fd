"""OpenAI- and Anthropic-compatible HTTP API."""
