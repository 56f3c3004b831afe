"""Engines: token ids in, token ids + logprobs out. They know nothing about chat formats."""
