"""ctconvert: offline conversion of Hugging Face checkpoints to compressed-tensors."""

__version__ = "0.1.0"
