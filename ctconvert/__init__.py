"""ctconvert: offline conversion of Hugging Face checkpoints to compressed-tensors."""

__version__ = "0.2.0"
