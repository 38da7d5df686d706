"""What the stitched model means: projector, scatter, binding, artifacts, loading, provenance."""
