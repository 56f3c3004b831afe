"""Anthropic's Messages API: routes, wire models and serving side by side."""
