"""How stitch is made fast: decode workers, shared slots, kernels; behind narrow seams, below data/ and model/."""
