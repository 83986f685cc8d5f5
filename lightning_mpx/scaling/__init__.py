"""Loss scaling: the dynamic scaler, the fused unscale-and-check passes (PyTorch and Triton) and their workspace."""
