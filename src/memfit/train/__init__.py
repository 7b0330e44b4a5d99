"""Running: the Trainer, training-state save and resume, data, and built-in models."""
