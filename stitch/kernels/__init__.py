"""How stitch is made fast: varlen attention and sample starts, chunked cross-entropy, half-precision LoRA,
CUDA graphs, decode workers and shared slots for prepare. Each path has a reference it must equal; this floor
imports torch and nothing of stitch above it."""
