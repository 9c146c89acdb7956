"""Exporters to ONNX and GGUF (installed as `quantgate.export`). Filled in by the export issues."""
