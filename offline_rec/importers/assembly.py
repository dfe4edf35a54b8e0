"""What an import makes of the parsed rows: its groups, the lines left out, and the manifest's blocks.

The import (`importers.import_dataset`) drops the bad lines (`drop_lines`, with the lines that
teacher-forced scoring cannot take: `scoring_rejects`), assembles the good rows into groups
(`assemble_groups`) and writes them with the `source`, `behavior` and `task` blocks made here.
"""

from __future__ import annotations

from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.format import make_row
from offline_rec.files import sha256_file
from offline_rec.importers.common import EMPTY_PROMPT, TOKEN_OUT_OF_RANGE, ParsedRow, Reject
from offline_rec.importers.config import ImportConfig


def drop_lines(rows: list[ParsedRow], bad: list[Reject]) -> list[ParsedRow]:
    lines = {(r.file, r.line) for r in bad}
    return [p for p in rows if (p.file, p.line) not in lines]


def scoring_rejects(rows: list[ParsedRow], vocab_rows: int) -> list[Reject]:
    """Lines that teacher-forced scoring cannot handle (one Reject per line)."""
    rejects: dict[tuple[str, int], Reject] = {}
    for p in rows:
        if (p.file, p.line) in rejects:
            continue
        if not p.row[S.PROMPT_IDS]:
            rejects[(p.file, p.line)] = Reject(
                p.file, p.line, EMPTY_PROMPT, "empty prompt: the first completion token has no context to be scored in"
            )
        elif max(p.row[S.PROMPT_IDS] + p.row[S.COMPLETION_IDS]) >= vocab_rows:
            rejects[(p.file, p.line)] = Reject(
                p.file,
                p.line,
                TOKEN_OUT_OF_RANGE,
                f"a token id is beyond the scoring model's {vocab_rows} embedding rows",
            )
    return list(rejects.values())


def assemble_groups(rows: list[ParsedRow]) -> list[list[dict]]:
    """Rows grouped by group id (groups in order of first appearance), sample_index 0..K-1 by `order`."""
    groups: dict[str, list[ParsedRow]] = {}
    for parsed in rows:
        groups.setdefault(parsed.group_id, []).append(parsed)
    return [
        [
            make_row(group_id=group_id, sample_index=index, **parsed.row)
            for index, parsed in enumerate(sorted(members, key=lambda p: p.order))
        ]
        for group_id, members in groups.items()
    ]


def source_block(config: ImportConfig, files: list[Path], tokenizer_path: str | None, format_options: dict) -> dict:
    """The manifest's `source` block: the files read (with hashes) and the options that shaped the rows (those
    every format reads, then the format's own: `format_options`, from its module's `source_options`)."""
    src = Path(config.src)
    block: dict = {"command": "import", "format": config.format, "file": str(src)}
    if len(files) == 1 and files[0] == src:
        block["sha256"] = sha256_file(src)
    else:
        block["files"] = [{"path": str(f), "sha256": sha256_file(f)} for f in files]
    block["options"] = {"tokenizer": tokenizer_path, "score_with": config.score_with, **format_options}
    return block


def behavior_block(groups: list[list[dict]], sampling: dict, config: ImportConfig, tok_hash: str | None,
                   logprobs_source: str, recomputed: dict) -> dict:
    """Provenance: the model (--behavior, else the one the source names), the sampling settings the
    whole source agrees on, the tokenizer hash and what the log-probs are."""
    sampling = dict(sampling)
    source_model = sampling.pop("model", None)
    behaviors = sorted({row[S.BEHAVIOR] for group in groups for row in group} - {"unknown"})
    return S.behavior_provenance(
        model=config.behavior or source_model or (behaviors[0] if len(behaviors) == 1 else None),
        tokenizer_hash=tok_hash,
        logprobs_source=logprobs_source,
        **{k: sampling.get(k) for k in ("temperature", "top_p", "top_k", "max_new_tokens", "seed")},
        **recomputed,
    )


def task_block(groups: list[list[dict]], config: ImportConfig) -> dict:
    """--task (else the rows' one task name, else "mixed"); rewards, if any, came with the source."""
    tasks = sorted({row[S.TASK] for group in groups for row in group})
    any_reward = any(row[S.REWARD] is not None for group in groups for row in group)
    return {
        "name": config.task or (tasks[0] if len(tasks) == 1 else "mixed"),
        "reward_function": "source" if any_reward else None,
    }
