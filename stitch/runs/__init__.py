"""stitch.runs."""
