"""`offline-rec view` at scale: how long until a big dataset's page shows its first groups.

view_first_paint_1m_s (full mode: 1M rows; `view_first_paint_s` at any size, with `view_rows`) =
  build: wall seconds of a fresh process doing what `offline-rec view DATASET --out page.html` does before
  the page can open (imports; open the dataset and its tokenizer; the group index, one pass over the group
  ids, rewards, finish reasons and completion lengths of every shard; the first page's rows; the HTML
  written), interpreter start included
+ browser: wall seconds of headless Chromium opening that page from disk (file://) until --dump-dom
  returns the DOM with the first page drawn (checked: <body data-rendered="20">), browser start included.
Browser start-up alone (about:blank, the same flags) is reported as view_browser_blank_s. Apart from
first paint: view_open_seconds (inside the build: load the tokenizer, which imports transformers, and
the index pass), view_index_seconds (the index pass alone, timed again after the build), view_page_ms
(median ms to build and serialize one further page: what each page file of --out or each page --serve
answers costs, over the next 20 pages), view_page_mb (the HTML's size). The first-paint keys are null
where chromium is not installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks._common import median, run_child

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")
TIMED_PAGES = 20


def first_page(data: str, tokenizer: str, out: str) -> dict:
    """In a fresh process: open the view (index pass) and write the page; then time further pages."""
    started = time.perf_counter()
    from offline_rec.view.config import ViewConfig
    from offline_rec.view.page import open_view, page_file_text, write_page
    from offline_rec.view.page_data import scan_index

    imported = time.perf_counter()
    view = open_view(ViewConfig(dataset=data, out=out, tokenizer=tokenizer))
    opened = time.perf_counter()
    write_page(view, Path(out))
    written = time.perf_counter()
    begin = time.perf_counter()  # the index pass alone, again (the shards now in the page cache)
    scan_index(view.reader.dataset, view.config.groups_per_page)
    index_seconds = time.perf_counter() - begin
    page_seconds = []
    for number in range(1, min(view.num_pages, 1 + TIMED_PAGES)):
        begin = time.perf_counter()
        page_file_text(number, view.page(number))
        page_seconds.append(time.perf_counter() - begin)
    return {"import_seconds": imported - started, "open_seconds": opened - imported, "index_seconds": index_seconds,
            "build_seconds": written - started, "page_ms": 1000 * median(page_seconds) if page_seconds else None,
            "groups": view.index.num_groups, "pages": view.num_pages}


def chromium_seconds(url: str) -> tuple[float, str]:
    """Wall seconds of headless Chromium loading `url` until --dump-dom returns its DOM, in a fresh profile
    (without --dump-dom or --screenshot, headless Chromium would keep running)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise FileNotFoundError("chromium")
    with tempfile.TemporaryDirectory(prefix="view-bench-") as profile:
        started = time.perf_counter()
        done = subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                              capture_output=True, text=True, timeout=300)
        seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited {done.returncode}: {done.stderr[-500:]}")
    return seconds, done.stdout


def first_paint(data: str, tokenizer: str, workdir: str, rows: int, threads: int | None = None) -> dict:
    """The numbers of the module docstring for dataset `data` of `rows` rows."""
    out = Path(workdir) / "page.html"
    built = run_child("_view_bench", "first_page", dict(data=data, tokenizer=tokenizer, out=str(out)),
                      threads=threads)
    result = {"view_rows": float(rows), "view_index_seconds": built["index_seconds"],
              "view_open_seconds": built["open_seconds"], "view_page_ms": built["page_ms"],
              "view_page_mb": out.stat().st_size / 2**20, "view_build_seconds": built["_seconds"]}
    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        return result
    browser, dom = chromium_seconds(out.as_uri())
    rendered = re.search(r'data-rendered="(\d+)"', dom)
    if rendered is None or int(rendered.group(1)) == 0:
        raise RuntimeError("the page did not draw its first groups in Chromium")
    blank, _ = chromium_seconds("about:blank")
    result.update(view_browser_seconds=browser, view_browser_blank_s=blank,
                  view_first_paint_s=built["_seconds"] + browser)
    if rows == 1_000_000:
        result["view_first_paint_1m_s"] = result["view_first_paint_s"]
    return result
