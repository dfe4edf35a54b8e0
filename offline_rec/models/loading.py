"""Load policies and tokenizers with clear errors, fingerprint a tokenizer by its content, check data against them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.models.gguf import converted_folder, gguf_file_in, is_gguf_name

DTYPES = ("auto", "float32", "bfloat16", "float16")


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's content: vocabulary, merges, normalization, special tokens, chat template.

    Saving and reloading the same tokenizer gives the same hash; file layout and JSON formatting
    do not matter. Two datasets may be mixed, or a policy trained on a dataset, only when the
    hashes agree.
    """
    content: dict = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens": sorted((k, str(v)) for k, v in (tokenizer.special_tokens_map or {}).items()),
        "added_tokens": sorted((str(t), i) for t, i in (tokenizer.get_added_vocab() or {}).items()),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        model = spec.get("model") or {}
        content["merges"] = model.get("merges")
        content["model_type"] = model.get("type")
        for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
            content[part] = spec.get(part)
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def model_source(name_or_path: str, model_folder: bool = True) -> str:
    """What transformers and vLLM load for `name_or_path`: a local model folder or a Hub id as given; a GGUF
    file, or a folder holding one, as its converted plain folder (`gguf.converted_folder`, built once).

    One-line UserErrors: a path that exists nowhere and cannot be a Hub id is named; a local folder
    without config.json (`model_folder=False` accepts one: a LoRA checkpoint) or a file that is not
    GGUF is refused. A name that could be a Hub id is left to the Hub (see `_load_error`).
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        gguf_file = gguf_file_in(path)
        if gguf_file is not None:
            return str(converted_folder(gguf_file))
        if path.is_file():
            raise UserError(f"model {name_or_path} is a file: give a model folder (save_pretrained) or a .gguf file")
        if model_folder and not (path / "config.json").exists():
            raise UserError(
                f"model {name_or_path} has no config.json (a transformers model folder, e.g. made by save_pretrained, "
                f"or a folder holding a .gguf file, is expected)"
            )
        return name_or_path
    if not could_be_hub_id(name_or_path):
        raise UserError(f"model {name_or_path} does not exist")
    return name_or_path


def could_be_hub_id(name: str) -> bool:
    """Whether `name` is spelled like a Hugging Face Hub model id ("org/name" or "name"), not like a path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "/", "~")) or is_gguf_name(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _load_error(action: str, name_or_path: str, error: Exception) -> UserError:
    """One line for a failed from_pretrained ("cannot {action} {name_or_path}: why"); for a name that is no
    local path it says both readings."""
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    if not Path(name_or_path).expanduser().exists():
        return UserError(f"cannot {action} {name_or_path}: there is no such local folder or file, and as a "
                         f"Hugging Face Hub id: {reason}")
    return UserError(f"cannot {action} {name_or_path}: {reason}")


def load_tokenizer(name_or_path: str, model_folder: bool = True):
    """AutoTokenizer with a pad token (EOS where it has none). `model_folder=False` accepts a local
    folder without config.json (a LoRA checkpoint: adapter and tokenizer files only)."""
    from transformers import AutoTokenizer

    source = model_source(name_or_path, model_folder)
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise _load_error("load a tokenizer from", name_or_path, e) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def torch_dtype(name: str | None, model_path: str | None = None):
    """torch dtype for `name`; "auto"/None means the checkpoint's saved dtype (float32 if unknown)."""
    import torch

    if name in (None, "auto"):
        saved = None
        exists = model_path is not None and Path(model_path).expanduser().exists()
        folder = Path(model_source(model_path, model_folder=False)) if exists else None  # a GGUF: its conversion
        if folder is not None and (folder / "config.json").exists():
            cfg = json.loads((folder / "config.json").read_text())
            saved = cfg.get("dtype") or cfg.get("torch_dtype")
        name = saved or "float32"
    if name not in DTYPES[1:]:
        raise UserError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return getattr(torch, name)


def load_model(name_or_path: str, dtype: str | None = "auto", device: str | None = None,
               attn_implementation: str | None = None):
    """AutoModelForCausalLM in `dtype` (default: the saved dtype), in eval mode; `attn_implementation`
    (e.g. "flash_attention_2", "sdpa") as transformers takes it, None for its default."""
    from transformers import AutoModelForCausalLM

    source = model_source(name_or_path)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype(dtype, source), **extra)
    except (OSError, ValueError, ImportError) as e:  # ImportError: an attention kernel that is not installed
        raise _load_error("load a causal LM from", name_or_path, e) from None
    if device:
        model.to(device)
    model.eval()
    return model


def embedding_rows(model) -> int:
    """Rows of a loaded model's input embedding: the largest vocabulary it can read."""
    embeddings = model.get_input_embeddings()
    # num_embeddings, not weight.shape: under ZeRO-3 the weight is an empty partition outside forward
    return getattr(embeddings, "num_embeddings", None) or embeddings.weight.shape[0]


def config_vocab_size(name_or_path: str) -> int | None:
    """The embedding rows a model's config declares (None if it does not say), without loading weights."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_source(name_or_path, model_folder=False))
    except (OSError, ValueError) as error:
        raise _load_error("read the model config of", name_or_path, error) from None
    return getattr(config.get_text_config(), "vocab_size", None)


def check_tokenizer_fits(tokenizer, rows: int | None, where: str = "") -> None:
    """Refuse a tokenizer with more tokens than `rows`, the model's embedding rows (None: unknown, accepted)."""
    if rows is not None and len(tokenizer) > rows:
        raise UserError(
            f"tokenizer{where} has {len(tokenizer)} tokens but the model's embedding has {rows} rows: model and "
            f"tokenizer do not match"
        )


def check_model_tokenizer(model, tokenizer, where: str = "") -> None:
    """Refuse a tokenizer whose vocabulary does not fit the loaded model's embedding matrix."""
    check_tokenizer_fits(tokenizer, embedding_rows(model), where)


def check_token_ids_fit(max_token_id: int, rows: int | None, model: str) -> None:
    """Refuse data holding a token id the model has no embedding for (`rows` None: unknown, accepted)."""
    if rows is not None and max_token_id >= rows:
        raise UserError(f"the data holds token id {max_token_id} but {model} has {rows} embeddings: "
                        "data and model do not match")


def check_tokenizers(datasets, tokenizer, model: str) -> None:
    """The datasets' recorded tokenizer hashes (manifest behavior.tokenizer_hash) must agree with the model's."""
    recorded = {str(d.path): d.behavior.get("tokenizer_hash") for d in datasets}
    recorded = {path: h for path, h in recorded.items() if h}
    if not recorded:
        return
    mine = tokenizer_hash(tokenizer)
    for path, digest in recorded.items():
        if digest != mine:
            raise UserError(f"dataset {path} was tokenized with another tokenizer than {model}'s "
                            f"(tokenizer_hash {digest[:12]} != {mine[:12]}); train a policy with the same tokenizer")


# Config attributes that hold a causal LM's context length, by architecture family.
_CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


def model_context(name_or_path: str) -> int | None:
    """The number of positions model `name_or_path` was built for (its config's max_position_embeddings
    or equivalent), read from config.json alone; None when the config names none or cannot be read.

    A longer sequence either crashes the forward (learned position embeddings) or is silently
    extrapolated (rotary): commands that score logged rows refuse such rows up front.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_source(name_or_path))
    except (OSError, ValueError, UserError):
        return None
    for attribute in _CONTEXT_ATTRIBUTES:
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
