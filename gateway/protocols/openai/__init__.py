"""OpenAI's chat completions, completions and model list: routes, wire models and serving side by side."""
