"""GGUF model files (llama.cpp's format) as plain transformers folders: dequantized once, cached, reused.

transformers reads a GGUF file (with the `gguf` package: the `gguf` extra) and dequantizes it, but the
model it returns keeps a GGUF quantization config that `save_pretrained` refuses to write, and vLLM
reads GGUF through its own, partial path. So every command is given a plain folder instead: the
dequantized float32 weights copied into a model built from the same config without its quantization
config, saved as safetensors with the tokenizer (chat template included) and the generation config.
The folder is built once per GGUF file (its path, size and modification time) in
``<cache root>/models/`` and reused; checkpoints trained from it are plain safetensors too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from offline_rec.errors import UserError, require_extra
from offline_rec.files import cache_root

GGUF_SUFFIX = ".gguf"
MODELS_DIR = "models"  # under the cache root
SOURCE_FILE = "gguf_source.json"  # in a converted folder: the file it was made from


def is_gguf_name(name_or_path: str) -> bool:
    """Whether `name_or_path` names a GGUF file (by its suffix), whether or not it exists."""
    return name_or_path.lower().endswith(GGUF_SUFFIX)


def gguf_file_in(path: Path) -> Path | None:
    """The GGUF file `path` stands for: `path` itself when it is a .gguf file, the one .gguf file of a folder
    that has no config.json; None otherwise. A folder holding several GGUF files is refused (name one)."""
    if path.is_file():
        return path if is_gguf_name(path.name) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.is_file() and is_gguf_name(p.name))
    if len(found) > 1:
        raise UserError(f"model folder {path} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                        f"name the one to use, e.g. --model {found[0]}")
    return found[0] if found else None


def converted_folder(gguf_path: Path, cache: Path | None = None) -> Path:
    """The plain transformers folder of `gguf_path`, converted now (and announced on stderr) if the cache has
    none. `cache`: default ``<cache root>/models``."""
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    identity = f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode("utf-8")).hexdigest()[:16]
    root = cache if cache is not None else cache_root() / MODELS_DIR
    folder = root / f"{gguf_path.stem}-{key}"
    if (folder / SOURCE_FILE).is_file():  # written last: the folder is complete
        return folder
    require_extra(f"model {gguf_path} is a GGUF file: reading it", "gguf", "gguf")
    try:
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
        work.chmod(0o755)  # mkdtemp's 0700 would hide the shared cache from other users
    except OSError as error:
        raise UserError(f"cannot write the converted model under {root} ({error.strerror or error}); "
                        "set $OFFLINE_REC_CACHE to a writable folder") from None
    print(f"converting GGUF model {gguf_path} into a plain safetensors folder, once: {folder}",
          file=sys.stderr, flush=True)
    try:
        write_plain_model(gguf_path, work)
        (work / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_path), "size": stat.st_size,
                                                    "mtime_ns": stat.st_mtime_ns}) + "\n")
        try:
            os.replace(work, folder)
        except OSError:  # another process finished the same conversion first: theirs is as good
            if not (folder / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def write_plain_model(gguf_path: Path, out: Path) -> None:
    """Dequantize `gguf_path` (float32) and save it into `out` as a plain model folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise UserError(f"cannot read GGUF model {gguf_path}: {str(error).splitlines()[0]}") from None
    config = quantized.config
    # The quantization config is what makes save_pretrained refuse; the weights are already dequantized.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())  # strict: every key of the same architecture
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
