"""stitch.model."""
