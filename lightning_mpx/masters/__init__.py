"""FP32 master weights: one model's masters, the engine's set of them, their swap into optimizers, resume across
levels."""
