"""UniRL: distributed reinforcement learning for generative models."""
