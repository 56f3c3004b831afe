"""OpenAI's Responses API: routes, wire models and serving side by side."""
