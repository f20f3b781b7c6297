"""Hand-written device kernels of the hop loop (Triton on CUDA; every kernel has an eager reference)."""
