"""What a model is made of, read from metadata alone, and the embedded demo model."""
