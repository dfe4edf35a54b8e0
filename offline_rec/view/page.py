"""`offline-rec view`: build the self-contained HTML page of a dataset, and write it with its page files.

The page holds its style and script inline (assets.py), the dataset's facts and group index, and
the first `inline_pages` pages of groups; the other pages are written as page files in a folder
next to it (PAGE_files/page-00001.js, loaded on demand by <script src>, which works from file://)
or served as JSON by `serve.py`. Every piece of data enters the HTML as JSON inside
<script type="application/json">, with <, >, & and U+2028/U+2029 escaped (`script_json`), so no text
of the data can close the block or be parsed as HTML; the script builds the DOM with textContent.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.view.assets import SCRIPT, STYLE
from offline_rec.view.config import ViewConfig
from offline_rec.view.page_data import (
    PageIndex,
    PageReader,
    TeacherForcedScorer,
    TokenText,
    page_payload,
    scan_index,
)

PAGE_FILE = "page-{number:05d}.js"

_SCRIPT_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                                 "\u2029": "\\u2029"})
# The page refuses anything from the network: scripts only inline or from files next to it, fetch only
# from the server that sent it (--serve).
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'unsafe-inline' 'self' file:; "
                           "style-src 'unsafe-inline'; connect-src 'self'; img-src data:")


def script_json(value) -> str:
    """`value` as JSON safe inside an HTML <script> element and a JavaScript file: the characters that
    could end the element or a JavaScript string are written as \\u escapes (they occur only inside strings)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).translate(_SCRIPT_ESCAPES)


@dataclass
class View:
    """An opened view: the dataset's index, and what turns one page of it into data."""

    config: ViewConfig
    facts: dict
    index: PageIndex
    reader: PageReader
    text: TokenText
    spec: object
    scorer: TeacherForcedScorer | None

    @property
    def num_pages(self) -> int:
        return len(self.index.pages)

    def page(self, number: int) -> dict:
        if not 0 <= number < self.num_pages:
            raise IndexError(f"page {number} of {self.num_pages}")
        return page_payload(self.reader.rows(number), self.text, self.spec, self.scorer)

    def meta(self, serve: bool, page_dir: str = "") -> dict:
        return {**self.facts, "groupsPerPage": self.config.groups_per_page, "serve": serve, "pageDir": page_dir}


def _tokenizer_for(config: ViewConfig, behavior: dict, warn) -> tuple[object | None, str]:
    """The tokenizer the token text comes from, and where it came from: --tokenizer or --model (a load error is
    the user's), else the behavior model of the manifest (a load error is a warning: token ids are shown)."""
    from offline_rec.models.loading import load_tokenizer

    given = config.tokenizer or config.model
    if given:
        return load_tokenizer(given, model_folder=False), given
    recorded = behavior.get("model")
    if not recorded:
        warn("the manifest names no behavior model: tokens are shown by id (give --tokenizer for their text)")
        return None, ""
    try:
        return load_tokenizer(recorded, model_folder=False), recorded
    except UserError as error:
        warn(f"{error}; tokens are shown by id (give --tokenizer for their text)")
        return None, ""


def open_view(config: ViewConfig, warn=lambda message: None) -> View:
    """Open the dataset, its tokenizer and (with --model) the policy; scan the group index."""
    from offline_rec.dataset.format import open_dataset
    from offline_rec.loss.presets import get_preset

    dataset = open_dataset(config.dataset)
    spec = get_preset(config.algorithm).objective
    behavior = dataset.behavior
    tokenizer, tokenizer_source = _tokenizer_for(config, behavior, warn)
    sampling = behavior.get("sampling") or {}
    temperature = config.temperature or sampling.get("temperature") or 1.0
    scorer = None
    if config.model:
        from offline_rec.models.loading import check_model_tokenizer, check_tokenizers, load_model

        model = load_model(config.model, dtype=config.dtype or "auto", device=config.device)
        check_model_tokenizer(model, tokenizer, f" of {config.model}")
        check_tokenizers([dataset], tokenizer, config.model)
        scorer = TeacherForcedScorer(model, tokenizer, float(temperature), config.batch_size, config.model)
    index = scan_index(dataset, config.groups_per_page)
    facts = {
        "name": dataset.path.resolve().name, "path": str(dataset.path), "rows": dataset.num_rows,
        "groups": index.num_groups, "behaviorModel": behavior.get("model"),
        "logprobsSource": behavior.get("logprobs_source"), "temperature": float(temperature),
        "tokenizer": tokenizer_source, "model": config.model,
        "algorithm": {"name": config.algorithm, "clip": spec.clip, "epsLow": spec.eps_low, "epsHigh": spec.eps_high,
                      "stdNormalize": spec.std_normalize, "drop": spec.drop},
    }
    return View(config=config, facts=facts, index=index, reader=PageReader(dataset, index), text=TokenText(tokenizer),
                spec=spec, scorer=scorer)


_BODY = """<header>
<h1 id="title"></h1>
<div class="facts" id="facts"></div>
<div class="legend"><span>colour:</span>
<span class="swatch" style="background:hsl(0,75%,80%)">unlikely under the behavior</span>
<span class="swatch" style="background:hsl(120,75%,88%)">likely</span>
<span class="swatch" style="background:rgba(220,38,38,.5)">rho &gt; 1 (policy prefers)</span>
<span class="swatch" style="background:rgba(37,99,235,.5)">rho &lt; 1</span>
<span class="tok env">environment (loss_mask 0)</span>
<span class="tok drop">dropped by the clip mask</span>
<span class="hex">\u27e8e4 bd\u27e9 bytes of a partial character</span>
</div>
</header>
<form class="filters" id="filters">
<label>mean reward &ge;<input id="f-rmin" type="number" step="any"></label>
<label>mean reward &le;<input id="f-rmax" type="number" step="any"></label>
<label>longest response &ge;<input id="f-lmin" type="number" step="1" min="0"></label>
<label>longest response &le;<input id="f-lmax" type="number" step="1" min="0"></label>
<label>finish reason<select id="f-finish"><option value="">any</option></select></label>
<label>group signal<select id="f-signal"><option value="">any</option><option value="1">signal (rewards differ)</option>
<option value="0">no signal (rewards equal)</option><option value="-1">unrewarded</option></select></label>
<label>colour by<select id="colour-by"><option value="behavior">behavior log-prob</option>
<option value="ratio">policy / behavior ratio</option></select></label>
<button type="submit">filter</button><button type="reset">clear</button>
</form>
<nav class="pager"><button id="prev" type="button">&larr; previous</button><span id="page-label"></span>
<button id="next" type="button">next &rarr;</button><span id="status"></span></nav>
<main id="groups"></main>
"""

_FACTS_SCRIPT = r"""
(function () {
  const meta = JSON.parse(document.getElementById("view-meta").textContent);
  document.getElementById("title").textContent = "offline-rec view: " + meta.name;
  const facts = document.getElementById("facts");
  const add = (text, className) => {
    const span = document.createElement("span");
    if (className) span.className = className;
    span.textContent = text;
    facts.appendChild(span);
  };
  add(meta.rows + " rows, " + meta.groups + " groups");
  add("behavior " + (meta.behaviorModel || "unknown") + " (log-probs: " + (meta.logprobsSource || "unknown")
      + ", temperature " + meta.temperature + ")");
  const a = meta.algorithm;
  add("algorithm " + a.name + " (clip " + a.clip + ", eps " + a.epsLow + "/" + a.epsHigh + ")");
  add(meta.model ? "policy " + meta.model : "no policy (--model): ratios not shown");
  if (!meta.tokenizer) add("no tokenizer: tokens shown by id", "warning");
})();
"""


def render_html(meta: dict, index: dict, inline_pages: dict[int, dict]) -> str:
    """The page: style, body, the data blocks (escaped JSON) and the script, one string."""
    blocks = [f'<script type="application/json" id="view-meta">{script_json(meta)}</script>',
              f'<script type="application/json" id="view-index">{script_json(index)}</script>']
    blocks += [f'<script type="application/json" id="view-page-{number}">{script_json(payload)}</script>'
               for number, payload in sorted(inline_pages.items())]
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CONTENT_SECURITY_POLICY}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>offline-rec view: {html.escape(meta['name'])}</title>",
        f"<style>{STYLE}</style>",
        "</head>",
        "<body>",
        _BODY,
        *blocks,
        f"<script>{_FACTS_SCRIPT}</script>",
        f"<script>{SCRIPT}</script>",
        "</body>",
        "</html>",
        "",
    ])


def page_file_text(number: int, payload: dict) -> str:
    """A page file: a script that hands its page to the viewer (<script src> works from file://, fetch does not)."""
    return f"offlineRecViewPage({number},{script_json(payload)});\n"


def page_folder(out: Path) -> Path:
    """Where the page files of page `out` go: next to it, named after it."""
    return out.with_name(out.stem + "_files")


def write_page(view: View, out: Path) -> Path:
    """Write the HTML of `view` to `out` (atomically): its first `inline_pages` pages inline, the rest left to
    page files in `page_folder(out)`. The page opens from then on."""
    if out.exists() and out.is_dir():
        raise UserError(f"--out {out} is a directory; give the HTML file's name")
    out.parent.mkdir(parents=True, exist_ok=True)
    inline = {number: view.page(number) for number in range(min(view.config.inline_pages, view.num_pages))}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(render_html(view.meta(serve=False, page_dir=page_folder(out).name), view.index.to_json(), inline),
                   encoding="utf-8")
    os.replace(tmp, out)
    return out


def write_page_files(view: View, out: Path, progress: bool = True) -> Path | None:
    """Write the page files of the pages `out` does not hold inline (earlier ones of the same name are removed);
    their folder, or None when every page is inline."""
    from offline_rec.progress import ProgressBar

    folder = page_folder(out)
    if folder.exists():
        for old in folder.glob("page-*.js"):
            old.unlink()
    rest = range(min(view.config.inline_pages, view.num_pages), view.num_pages)
    if not len(rest):
        if folder.exists() and not any(folder.iterdir()):
            folder.rmdir()
        return None
    folder.mkdir(exist_ok=True)
    with ProgressBar("view pages", len(rest), enabled=progress) as bar:
        for number in rest:
            (folder / PAGE_FILE.format(number=number)).write_text(page_file_text(number, view.page(number)),
                                                                  encoding="utf-8")
            bar.advance(1)
    return folder


def write_view(config: ViewConfig, warn=lambda message: None, progress: bool = True) -> dict:
    """`offline-rec view --out`: the page first (it opens from then on), then its page files.
    Returns a summary: page, page_files (folder or None), pages, groups, rows."""
    view = open_view(config, warn)
    out = write_page(view, config.out)
    folder = write_page_files(view, out, progress)
    return {"page": str(out), "page_files": None if folder is None else str(folder), "pages": view.num_pages,
            "groups": view.index.num_groups, "rows": int(sum(view.index.size))}
