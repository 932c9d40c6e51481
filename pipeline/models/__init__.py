"""Model families in our own PyTorch, loaded from Hugging Face checkpoints."""
