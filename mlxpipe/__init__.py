"""mlxpipe: pipeline-parallel LLM inference across Apple Silicon machines."""

__version__ = "0.1.0"
