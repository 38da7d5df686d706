"""How training is made fast: varlen attention and sample starts, chunked cross-entropy, half-precision LoRA,
CUDA graphs. Each kernel path has a reference path it must equal; this floor imports torch and nothing of
stitch above it."""
