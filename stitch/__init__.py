"""stitch: a frozen encoder + a trainable projector + a base LM, post-trained in stages."""

__version__ = "0.2.0"
