"""stitch.rollout."""
