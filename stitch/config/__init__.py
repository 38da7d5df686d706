"""stitch.config."""
