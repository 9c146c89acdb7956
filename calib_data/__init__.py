"""Calibration and evaluation text sources (installed as `quantgate.calib_data`), and the split policy."""
from .documents import SPLITS, Corpus, Document, split_of
from .sampling import TokenStream, sample_windows, sampled_documents, tokenize_corpus
from .sources import data_paths, load_corpus, read_text_file
from .splits import (calibration_split, calibration_windows, check_ctx, default_split, eval_windows, has_splits,
                     window_documents)
from .synthetic import SYNTHETIC_NAMES

__all__ = ["SPLITS", "Corpus", "Document", "split_of", "load_corpus", "read_text_file", "data_paths",
           "TokenStream", "tokenize_corpus", "sample_windows", "sampled_documents", "calibration_split", "calibration_windows",
           "check_ctx", "default_split", "eval_windows", "window_documents", "has_splits", "SYNTHETIC_NAMES"]
