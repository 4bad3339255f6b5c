"""Rollout workers: generation engines, reward functions, and the roller loop."""
