"""Hugging Face repo ids (`Qwen/Qwen3.5-0.8B`) as model arguments, resolved to a local folder by huggingface_hub.

Where the repo is in the local cache (HF_HUB_CACHE, default ~/.cache/huggingface/hub), that snapshot is used
without touching the network. Otherwise it is downloaded (huggingface_hub's progress bars) unless HF_HUB_OFFLINE
is set, in which case the answer is one error line. Only what quantgate reads is fetched: config and tokenizer
JSON and safetensors weights (pickled weights are never downloaded, as they are never loaded).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import QuantgateError
from .kind import artifact_kind

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja"]


def is_hub_id(name: str | Path) -> bool:
    """`org/name` that is not a path on this machine (a local folder of that name wins)."""
    s = str(name)
    return bool(REPO_ID.fullmatch(s)) and artifact_kind(s) == "hf" and not os.path.lexists(s)


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(name: str | Path) -> Path:
    """A local path for `name`: itself, or the cached (else downloaded) snapshot of a Hugging Face repo id."""
    if not is_hub_id(name):
        return Path(name)
    from huggingface_hub import snapshot_download  # imported only when a repo id is given
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id
    try:
        validate_repo_id(str(name))  # the Hub's own rule (no "--" or "..", no leading/trailing "-" or ".")
    except HFValidationError as e:
        raise QuantgateError(f"{name}: no such local path, and not a repo id the Hugging Face Hub accepts "
                             f"({' '.join(str(e).split())[:100]})") from None
    cache = os.environ.get("HF_HUB_CACHE") or None
    try:
        return Path(snapshot_download(str(name), cache_dir=cache, local_files_only=offline(), allow_patterns=FILES))
    except LocalEntryNotFoundError:
        where = cache or "the Hugging Face cache (~/.cache/huggingface/hub)"
        if offline():
            raise QuantgateError(f"{name}: not in {where} and HF_HUB_OFFLINE is set; download it once online, or "
                                 f"pass a local folder") from None
        raise QuantgateError(f"{name}: not in {where} and the Hub cannot be reached; pass a local folder") from None
    except RepositoryNotFoundError:
        raise QuantgateError(f"{name}: no such model repository on the Hugging Face Hub (or it is gated/private: "
                             f"log in with `hf auth login`)") from None
    except (HfHubHTTPError, OSError, ValueError) as e:  # ValueError: what else the Hub client refuses
        raise QuantgateError(f"{name}: download failed ({' '.join(str(e).split())[:120]})") from None
