"""stitch.data."""
