"""Rewards for turns of everyday traffic: the reward worker (`clawgate judge`), its LLM judge and reward functions.

``turns`` reads a turn from the store as text (context, reply, next state); ``judge`` asks a model for a score
through LiteLLM and parses its answer; ``functions`` loads users' own reward functions; ``worker`` claims turns,
runs them through all of these and records one verdict per turn.
"""
