"""Run by the transformers-5 interpreter (QUANTGATE_TF5_PYTHON), not by pytest: llama.cpp's own
convert_hf_to_gguf.py, from the llama-cpp-python sdist, as the reference GGUF writer.

`python llama_convert.py LLAMA_CPP_DIR JOBS.json`, each job the converter's arguments (a model folder, --outfile,
...), all in one process. One change to the converter, made here and nowhere else: it names a BPE pre-tokenizer by
the hash of known hub tokenizers' output (`TextModel.get_vocab_base_pre`), and a test's own small tokenizer has
no entry there, so the name is given as "qwen35" (what it returns for Qwen3.5's tokenizer). Tensors and every
other key are the converter's own. Between jobs, the --no-mtp / --mtp flags the converter sets on its model classes
(class attributes, which outlive one run in a shared process) are cleared, so each job sees only its own.
"""
from __future__ import annotations

import json
import runpy
import sys

if __name__ == "__main__":
    src = sys.argv[1]
    sys.path[:0] = [src, f"{src}/gguf-py"]
    import conversion.base as base  # the converter's package, from the sdist
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
    def classes(c):
        for sub in c.__subclasses__():
            yield sub
            yield from classes(sub)

    for args in json.loads(open(sys.argv[2]).read()):
        for c in classes(base.ModelBase):
            for flag in ("no_mtp", "mtp_only"):
                if flag in vars(c):
                    delattr(c, flag)
        sys.argv = [f"{src}/convert_hf_to_gguf.py", *args]
        try:
            runpy.run_path(f"{src}/convert_hf_to_gguf.py", run_name="__main__")
        except SystemExit as e:
            if e.code:
                raise
