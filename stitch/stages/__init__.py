"""stitch.stages."""
