"""The llama.cpp file and KV-cache types quantgate offers, by name: a leaf module, so the scheme registry and the
parsers of what users ask (quant.targets) read one list. Names as in gguf-py's own enums (llama_ftype, ggml_type),
which translate them where a number is needed (quant.schemes.llama_file_type, ggml_type)."""

GGUF_FILE_TYPES = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_NL",
                   "IQ4_XS", "Q3_K_M", "Q3_K_S", "Q3_K_L", "IQ3_S", "IQ3_XXS", "Q2_K")
GGUF_KV_TYPES = ("f32", "f16", "q8_0", "q4_0")  # llama.cpp KV-cache types quantgate runs (ggml_type)
NEEDS_IMATRIX = ("IQ3_XXS",)  # llama.cpp refuses these without an importance matrix
NO_GATE_OVERRIDE = ("F16", "BF16", "Q8_0")  # already 8 bits or more: nothing to keep
