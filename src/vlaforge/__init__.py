"""vlaforge: train Vision-Language-Action models efficiently, from one GPU to many nodes."""

__version__ = "0.1.0"

COMPONENTS = ("vision", "projector", "llm", "action_head")
"""The four children of every VLA; the vocabulary of configs, param groups, policies and metrics."""
