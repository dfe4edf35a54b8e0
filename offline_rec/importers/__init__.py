"""Turn logs written by other systems into an offline-rec dataset (`offline-rec import`).

One flat dict, `IMPORT_FORMATS`, names the source formats; each has its module here, whose
docstring says exactly what a line may hold:

- ``rows`` (rows.py): already in this project's column names, token ids and log-probs given.
- ``text`` (text.py): prompt, completion, optional reward and group id, tokenized here; needs
  --score-with.
- ``openai`` (openai.py): chat-completion (or completion) logs of an OpenAI-compatible server,
  vLLM's included, single calls and multi-turn tool episodes (episodes.py); token ids recovered
  exactly even from lossy token strings (calls.py, tokens.py); rewards that arrive later
  (--rewards, rewards.py).
- ``trl`` (trl.py): TRL GRPO completion logs; needs --score-with.

Each format's module owns what is the format's own: its parser (`parse`) reads the source files and
returns rows (grouped, with token ids) plus one `Reject` per source line it could not use, never
raising for bad data, whatever the bytes; `source_options` says which of its options shaped the rows
(the manifest's source block). The registry entry (`ImportFormat`) holds what is checked before a
line is read, and the options no other format takes. What every format shares is in common.py.
`import_dataset` then recomputes log-probs when asked (`--score-with`), refuses or sets aside the
bad lines, and writes the dataset atomically (absent or complete). Every option is a field of
`ImportConfig` (config.py), which the CLI builds from its flags.

Source files: JSON Lines (one JSON object per line; blank lines are ignored) or Parquet (read
whole; a Parquet source's "line" is its 1-based row number). SRC may be a directory: its
`*.jsonl`, `*.ndjson`, `*.json`, `*.parquet`, `*.pq` files are read in name order (TRL writes one
Parquet file per logging step).

Holds the parsed source in memory (groups may be spread over the whole file); split a very
large log into several imports.

Importing this package is cheap (standard library and typer): the CLI reads ImportConfig from it at
start-up; a format's module (pyarrow, tokenizers) is imported when the format is used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from pathlib import Path

from offline_rec.errors import UserError, one_of
from offline_rec.importers.config import ImportConfig
from offline_rec.options import flags_of

__all__ = ["IMPORT_FORMATS", "ImportConfig", "ImportFormat", "import_dataset"]


@dataclass(frozen=True)
class ImportFormat:
    """An import format as the registry holds it: what `import` checks before it reads a line, and the module
    of this package that owns the rest. That module defines the format's two hooks:

    - ``parse(files, tokenizer, config) -> common.ParseResult``: the source read into rows and Rejects;
    - ``source_options(config) -> dict``: the options of the format's own that shaped its rows, for the
      manifest's source block (the options every format reads are added to them).

    The module is imported when the format is used (pyarrow, tokenizers), not with this package.
    """

    module: str
    gives_logprobs: bool
    """Whether the source carries behavior log-probs (else --score-with is required)."""
    needs_tokenizer: bool
    description: str
    options: tuple[str, ...] = ()
    """The format-specific ImportConfig fields this format reads. A format-specific field (one that some format
    lists) set away from its default with a format that does not list it is refused, not silently ignored."""

    def parse(self, files: list[Path], tokenizer, config: ImportConfig):
        """The module's `parse`: (source files, tokenizer or None, ImportConfig) -> common.ParseResult."""
        return self._hooks().parse(files, tokenizer, config)

    def source_options(self, config: ImportConfig) -> dict:
        """The module's `source_options`: its entries in the manifest's source options."""
        return self._hooks().source_options(config)

    def _hooks(self):
        return importlib.import_module(f"{__name__}.{self.module}")


IMPORT_FORMATS: dict[str, ImportFormat] = {
    "rows": ImportFormat(
        "rows", gives_logprobs=True, needs_tokenizer=False,
        description="JSONL/Parquet already in this schema's columns (token ids and log-probs given)",
    ),
    "text": ImportFormat(
        "text", gives_logprobs=False, needs_tokenizer=True,
        description="prompt/completion/reward text, tokenized with --tokenizer; needs --score-with",
        options=("prompt_column", "completion_column", "reward_column", "group_column", "append_eos"),
    ),
    "openai": ImportFormat(
        "openai", gives_logprobs=True, needs_tokenizer=True,
        description="OpenAI-compatible chat/completion logs with logprobs (vLLM included)",
        options=("group_by_prompt", "split_episodes", "keep_messages", "rewards"),
    ),
    "trl": ImportFormat(
        "trl", gives_logprobs=False, needs_tokenizer=True,
        description="TRL GRPO completion logs (step, prompt, completion, reward columns); needs --score-with",
        options=("prompt_column", "completion_column", "append_eos", "reward_columns"),
    ),
}


def import_dataset(config: ImportConfig) -> dict:
    """Import config.src (format config.format) into the new dataset config.out; returns a summary.

    Bad lines make it raise common.BadLinesError (nothing written) unless `skip_bad`, which writes
    the good rows plus OUT/rejects.jsonl. `score_with` recomputes every log-prob teacher-forced with
    that model (replacing any the source gives); its tokenizer must equal `tokenizer`'s (which
    defaults to it). Three steps: the options checked (`_check`), the source parsed and its good rows
    scored (`_score`), the dataset written (`_write`).
    """
    checked = _check(config)
    parsed, good, rejects = _score(checked, config)
    return _write(checked, config, parsed, good, rejects)


@dataclass(frozen=True)
class _Checked:
    """What `_check` established about an import before any line is parsed."""

    spec: ImportFormat
    src: Path
    out: Path
    files: list
    logprobs_source: str
    tokenizer_path: str | None
    tokenizer: object
    tokenizer_hash: str | None


def _check(config: ImportConfig) -> _Checked:
    """Every option check, OUT refused if it exists, and the tokenizer loaded (and matched to --score-with's)."""
    from offline_rec.importers.common import source_files
    from offline_rec.models.loading import load_tokenizer, tokenizer_hash

    fmt, tokenizer, score_with = config.format, config.tokenizer, config.score_with
    if fmt not in IMPORT_FORMATS:
        raise one_of("import format", fmt, IMPORT_FORMATS)
    spec = IMPORT_FORMATS[fmt]
    src, out = Path(config.src), Path(config.out)
    files = source_files(src)
    _refuse_existing(out)
    if not spec.gives_logprobs and score_with is None:
        raise UserError(
            f"the {fmt} format has no log-probs and offline training needs them: pass --score-with MODEL "
            "to compute them teacher-forced (ideally the model that sampled the data)"
        )
    _refuse_options_of_other_formats(config)
    logprobs_source = _logprobs_source(config.logprobs_source, score_with)
    if config.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {config.batch_size}")

    tokenizer_path = tokenizer or score_with
    tok = load_tokenizer(tokenizer_path) if tokenizer_path else None
    tok_hash = tokenizer_hash(tok) if tok is not None else None
    if spec.needs_tokenizer and tok is None:
        raise UserError(f"the {fmt} format needs --tokenizer (or --score-with, whose tokenizer is then used)")
    if (
        score_with is not None
        and tokenizer_path != score_with
        and tokenizer_hash(load_tokenizer(score_with)) != tok_hash
    ):
        raise UserError(
            f"the tokenizer of --score-with {score_with} differs from --tokenizer {tokenizer}: "
            "the token ids would mean different text"
        )
    return _Checked(spec, src, out, files, logprobs_source, tokenizer_path, tok, tok_hash)


def _refuse_options_of_other_formats(config: ImportConfig) -> None:
    """A format-specific option (`ImportFormat.options`) that this format does not read, set: refused, not ignored."""
    declared = {field.name: field for field in fields(ImportConfig)}
    readers: dict[str, list[str]] = {}
    for name, spec in IMPORT_FORMATS.items():
        for option in spec.options:
            readers.setdefault(option, []).append(name)
    for option, formats in readers.items():
        value = getattr(config, option)
        if config.format not in formats and value != declared[option].default:
            on, _, off = flags_of(declared[option])[0].partition("/")  # a switch: the side that was given
            raise UserError(f"{off if off and value is False else on} applies to the {' and '.join(formats)} format"
                            f"{'s' if len(formats) > 1 else ''} only")


def _logprobs_source(given: str | None, score_with: str | None) -> str:
    """--logprobs-source: what the source's log-probs are ("unknown" unless told); "recomputed" with --score-with."""
    from offline_rec import schema as S

    if score_with is not None:
        if given not in (None, S.LOGPROBS_RECOMPUTED):
            raise UserError(
                f"--logprobs-source {given} describes the source's log-probs, but --score-with recomputes them; "
                "drop one"
            )
        return S.LOGPROBS_RECOMPUTED
    given = given or "unknown"
    if given not in S.LOGPROBS_SOURCES:
        raise one_of("--logprobs-source", given, S.LOGPROBS_SOURCES)
    return given


def _refuse_existing(out: Path) -> None:
    if out.exists() and (out.is_file() or any(out.iterdir())):
        raise UserError(f"output {out} already exists; choose another --out")


def _score(checked: _Checked, config: ImportConfig) -> tuple:
    """(parse result, good lines, rejects sorted by place): the source parsed, the bad lines refused (or set aside
    with --skip-bad), and the good rows' log-probs recomputed with --score-with."""
    from collections import Counter

    from offline_rec import schema as S
    from offline_rec.importers.assembly import drop_lines, scoring_rejects
    from offline_rec.importers.common import NO_LOGPROBS, REJECTS_FILE, BadLinesError
    from offline_rec.models.loading import check_model_tokenizer, load_model

    src, tok, score_with = checked.src, checked.tokenizer, config.score_with
    parsed = checked.spec.parse(checked.files, tok, config)
    if not parsed.rows and not parsed.rejects:
        raise UserError(f"{src}: no records to import")
    rejects = list(parsed.rejects)

    model = None
    if score_with is not None:
        model = load_model(score_with, dtype=config.dtype)
        check_model_tokenizer(model, tok, f" of {score_with}")
        rejects += scoring_rejects(drop_lines(parsed.rows, rejects), model.get_input_embeddings().weight.shape[0])
    elif not parsed.rows and any(r.code == NO_LOGPROBS for r in rejects):
        raise UserError(
            f"{src} gives no log-probs and offline training needs them: pass --score-with MODEL to compute them "
            "teacher-forced"
        )
    rejects.sort(key=lambda r: (r.file, r.line))

    if rejects and not config.skip_bad:
        shown = "; ".join(str(r) for r in rejects[:3])
        raise BadLinesError(
            f"{len(rejects)} bad line(s) in {src}, nothing written; first: {shown} "
            f"(fix them, or pass --skip-bad to import the good rows and list the bad ones in "
            f"{checked.out / REJECTS_FILE})",
            rejects,
        )
    good = drop_lines(parsed.rows, rejects)
    if not good:  # one line (not the list of bad lines that BadLinesError prints): the reasons, most common first
        reasons = ", ".join(f"{code} {n}" for code, n in Counter(r.code for r in rejects).most_common())
        raise UserError(f"every line of {src} was refused ({len(rejects)} bad line(s): {reasons}), nothing written; "
                        f"first: {rejects[0]}")
    if model is not None:
        from offline_rec.models.teacher_forced import teacher_forced_logprobs

        rows = [p.row for p in good]
        scored = teacher_forced_logprobs(
            model,
            tok,
            [r[S.PROMPT_IDS] for r in rows],
            [r[S.COMPLETION_IDS] for r in rows],
            batch_size=config.batch_size,
            temperature=config.score_temperature,
        )
        for row, logprobs in zip(rows, scored):
            row[S.BEHAVIOR_LOGPROBS] = logprobs
    return parsed, good, rejects


def _write(checked: _Checked, config: ImportConfig, parsed, good: list, rejects: list) -> dict:
    """The good rows as whole groups, written atomically to OUT with OUT/rejects.jsonl (--skip-bad); the summary."""
    import json
    from collections import Counter

    from offline_rec.dataset.format import DatasetWriter
    from offline_rec.importers.assembly import assemble_groups, behavior_block, source_block, task_block
    from offline_rec.importers.common import REJECTS_FILE

    out, score_with = checked.out, config.score_with
    groups = assemble_groups(good)
    recomputed = (
        {"logprobs_model": score_with, "logprobs_dtype": config.dtype,
         "logprobs_temperature": config.score_temperature}
        if score_with
        else {}
    )
    behavior = behavior_block(groups, parsed.sampling, config, checked.tokenizer_hash, checked.logprobs_source,
                              recomputed)
    by_code = Counter(r.code for r in rejects)
    imported_lines = len({(p.file, p.line) for p in good})
    with DatasetWriter(out, behavior=behavior, task=task_block(groups, config),
                       source=source_block(config, checked.files, checked.tokenizer_path,
                                           checked.spec.source_options(config)),
                       groups_per_shard=config.groups_per_shard, atomic=True) as writer:
        writer.add_groups(groups)
        writer.stats.update(
            {
                "source_records": parsed.records,
                "imported_lines": imported_lines,
                "rejected_lines": len(rejects),
                "rejects_by_reason": dict(sorted(by_code.items())),
                **parsed.stats,
            }
        )
        if rejects:  # inside the hidden directory: it appears together with the dataset
            with open(writer.path / REJECTS_FILE, "w", encoding="utf-8") as f:
                for r in rejects:
                    f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
    return {
        "out": str(out),
        "rows": sum(len(g) for g in groups),
        "groups": len(groups),
        "source_records": parsed.records,
        "imported_lines": imported_lines,
        "rejected_lines": len(rejects),
        "rejects_by_reason": dict(by_code),
        **parsed.stats,
        "rejects_file": str(out / REJECTS_FILE) if rejects else None,
        "logprobs_source": checked.logprobs_source,
    }
