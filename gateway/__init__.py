"""clawgate gateway: OpenAI/Anthropic-compatible serving with token-exact capture."""

__version__ = "0.1.0"
