"""quantgate: quantize and deploy LLMs with gated attention, and measure what the gate does to outliers."""
__version__ = "0.1.0"
