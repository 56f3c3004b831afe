"""The gateway's own HTTP API beside the model protocols: rollouts, rewards and feedback, policy versions, health
and metrics, the OpenAPI document. Each module holds its routes; ``*_wire.py`` their request models."""
