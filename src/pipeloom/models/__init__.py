"""Models the runtime trains (torch): a small LLaMA-style decoder cut into stages."""
