"""stitch.demo."""
