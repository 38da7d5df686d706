"""stitch.serve."""
