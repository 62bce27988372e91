"""Metric sinks and sample images."""

from unirl.tracking.metrics import JsonlWriter, save_image_grid

__all__ = ["JsonlWriter", "save_image_grid"]
