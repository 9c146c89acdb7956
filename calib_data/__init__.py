"""Calibration and evaluation text sources (installed as `quantgate.calib_data`)."""
from .documents import SPLITS, Corpus, Document, split_of
from .sampling import TokenStream, sample_windows, tokenize_corpus
from .sources import data_paths, load_corpus, read_text_file

__all__ = ["SPLITS", "Corpus", "Document", "split_of", "load_corpus", "read_text_file", "data_paths",
           "TokenStream", "tokenize_corpus", "sample_windows"]
