"""All Hugging Face Hub access: model metadata (headers only), its cache, and error mapping."""
