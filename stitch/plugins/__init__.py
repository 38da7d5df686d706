"""stitch.plugins."""
