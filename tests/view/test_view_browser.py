"""`offline-rec view` in a real browser: headless Chromium opens the page from disk (file://) and the test reads
the DOM it rendered, then takes a screenshot.

The dataset (tests/support/view_support.py) holds CJK, emoji and Arabic text cut into partial-UTF-8 tokens, a tool
episode with environment tokens (loss_mask 0), a completion that tries to run a script and to change the title,
and behavior log-probs that put known tokens outside the clip band of the policy (--model, the same checkpoint).
Chromium comes from Debian's `chromium` package (scripts/test.sh installs it where missing); the tests are
skipped where it is absent, and fail in CI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser

import pytest
from support.cli_support import cli_exit_code
from support.view_support import ARABIC, SCRIPT_COMPLETION, SHIFT_DOWN, SHIFT_UP, write_view_dataset

pytestmark = pytest.mark.browser

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=5000")


def missing(what: str):
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing in CI; scripts/test.sh installs Debian's chromium and chromium-driver")
    pytest.skip(f"{what} is not installed (apt-get install chromium chromium-driver)")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        missing("chromium")
    return found


def run_chromium(url: str, *arguments: str) -> str:
    """Chromium's stdout for `url` (with --dump-dom: the DOM after the page's scripts ran), in a fresh profile."""
    with tempfile.TemporaryDirectory(prefix="view-chromium-") as profile:
        result = subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *arguments, url],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@dataclass
class Node:
    tag: str
    attrs: dict
    children: list = field(default_factory=list)  # Node or str

    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def text(self) -> str:
        return "".join(child if isinstance(child, str) else child.text() for child in self.children)

    def find_all(self, tag: str, cls: str | None = None) -> list[Node]:
        found = []
        for child in self.children:
            if isinstance(child, Node):
                if child.tag == tag and (cls is None or cls in child.classes()):
                    found.append(child)
                found += child.find_all(tag, cls)
        return found


class _Tree(HTMLParser):
    VOID = {"meta", "link", "input", "br", "img", "hr", "source", "area", "base", "col", "embed", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs))
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        for depth in range(len(self.stack) - 1, 0, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def dom(url: str) -> Node:
    tree = _Tree()
    tree.feed(run_chromium(url, "--dump-dom"))
    return tree.root


def shown_bytes(completion: Node) -> bytes:
    """The bytes the tokens of a completion show: text as UTF-8, hex boxes as their bytes."""
    data = b""
    for token in completion.find_all("span", "tok"):
        for part in token.children:
            if isinstance(part, str):
                data += part.encode("utf-8")
            elif "hex" in part.classes():
                data += bytes.fromhex(part.text().strip("\u27e8\u27e9"))
            else:
                data += part.text().encode("utf-8")
    return data


@pytest.fixture(scope="module")
def page(vllm_tiny_model, tmp_path_factory):
    """The page of the test dataset with --model (2 groups a page: page 0 inline, pages 1-3 as page files)."""
    chromium()
    folder = tmp_path_factory.mktemp("view-browser")
    dataset, plan = write_view_dataset(folder / "ds", vllm_tiny_model)
    out = folder / "page.html"
    code = cli_exit_code("view", dataset, "--model", vllm_tiny_model, "--out", out, "--groups-per-page", 2, "-q")
    assert code == 0
    return out, plan


def _rows_by_key(root: Node) -> dict[tuple[str, int], Node]:
    return {(group.attrs["data-group"], int(row.attrs["data-sample"])): row
            for group in root.find_all("section", "group") for row in group.find_all("div", "row")}


def test_the_first_page_renders_every_token_and_runs_no_data(page):
    out, plan = page
    root = dom(out.as_uri())
    (title,) = root.find_all("title")
    assert title.text() == "offline-rec view: ds"  # the completion's <script> and onerror would set "pwned"
    (body,) = root.find_all("body")
    assert body.attrs.get("data-rendered") == "2"
    groups = [section.attrs["data-group"] for section in root.find_all("section", "group")]
    assert groups == ["g-cjk", "g-tool"]
    assert not root.find_all("img")  # the completion's <img onerror> is text, not an element
    assert len(root.find_all("script")) == 5  # meta, index, page 0, and the page's two scripts
    rows = _rows_by_key(root)
    for planned in plan[0] + plan[1]:
        row = rows[(planned.group, planned.sample)]
        (completion,) = row.find_all("div", "completion")
        assert completion.attrs.get("dir") == "auto"
        tokens = completion.find_all("span", "tok")
        assert len(tokens) == len(planned.completion_ids)
        environment = [i for i, token in enumerate(tokens) if "env" in token.classes()]
        assert environment == planned.env_positions
        dropped = [i for i, token in enumerate(tokens) if "drop" in token.classes()]
        assert dropped == (list(SHIFT_UP) if planned.sample == 0 else list(SHIFT_DOWN))  # A > 0, then A < 0
        assert shown_bytes(completion) == planned.text.encode("utf-8")  # every byte, partial characters as hex
        (prompt,) = row.find_all("details", "prompt")
        assert "open" not in prompt.attrs  # the prompt is collapsed
        head = row.find_all("div", "row-head")[0].text()
        assert f"reward {planned.reward:.3f}" in head and "policy_version 0" in head
    (arabic,) = rows[("g-cjk", 1)].find_all("div", "plain")  # the whole text, laid out right to left
    assert arabic.text() == ARABIC and arabic.attrs.get("dir") == "auto"
    cjk = rows[("g-cjk", 0)].find_all("div", "completion")[0]
    assert cjk.find_all("span", "hex"), "the CJK/emoji row must hold partial-UTF-8 tokens"
    assert "\ufffd" not in cjk.text()
    script_row = rows[("g-tool", 1)].find_all("div", "completion")[0]
    markup = SCRIPT_COMPLETION.split("\u2028")[0]  # the markup before the line separator (cut into bytes)
    assert "".join(t.text() for t in script_row.find_all("span", "tok")).startswith(markup)  # shown as text


def test_later_pages_load_their_page_files_and_filters_apply(page):
    out, _ = page
    root = dom(out.as_uri() + "#page=2")
    assert [s.attrs["data-group"] for s in root.find_all("section", "group")] == ["g-fill-1", "g-fill-2"]
    assert len(root.find_all("script")) == 6  # page-00002.js was loaded
    root = dom(out.as_uri() + "#signal=-1")
    assert [s.attrs["data-group"] for s in root.find_all("section", "group")] == ["g-cut"]
    (status,) = [n for n in root.find_all("span") if n.attrs.get("id") == "status"]
    assert status.text() == "1 of 8 groups match"
    root = dom(out.as_uri() + "#rmin=0.4&rmax=0.45")  # mean rewards: 0.5, 0.375, none, 0.5 ...: none match
    assert not root.find_all("section", "group")
    (status,) = [n for n in root.find_all("span") if n.attrs.get("id") == "status"]
    assert status.text() == "0 of 8 groups match"


def test_screenshot(page, tmp_path):
    out, _ = page
    shot = tmp_path / "view.png"
    run_chromium(out.as_uri(), f"--screenshot={shot}", "--window-size=1280,900")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a drawn page, not a blank one
    if os.environ.get("VIEW_SCREENSHOT"):  # keep it to look at
        shutil.copy(shot, os.environ["VIEW_SCREENSHOT"])


def test_served_pages_load_through_the_server(page):
    """--serve: the same page from the loopback server, later pages fetched as JSON."""
    import threading

    from offline_rec.view.config import ViewConfig
    from offline_rec.view.page import open_view
    from offline_rec.view.serve import make_server

    out, _ = page
    dataset = out.parent / "ds"
    server = make_server(open_view(ViewConfig(dataset=dataset, serve=True, groups_per_page=2)), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        root = dom(f"http://127.0.0.1:{server.server_address[1]}/#page=3")
    finally:
        server.shutdown()
        server.server_close()
    assert [s.attrs["data-group"] for s in root.find_all("section", "group")] == ["g-fill-3", "g-fill-4"]
    assert len(root.find_all("script")) == 5  # fetched, not loaded as scripts


def test_the_demo_data_with_its_policy(tmp_path):
    """What `offline-rec demo` collects (its shipped arith policy, the hf backend), viewed with that policy."""
    from offline_rec.dataset.format import open_dataset
    from offline_rec.demo.behavior_policy import demo_policy_path

    chromium()
    policy = demo_policy_path()
    assert cli_exit_code("collect", "--model", policy, "--task", "arith", "--num-prompts", 4, "-k", 4, "--backend",
                         "hf", "--max-new-tokens", 16, "--out", tmp_path / "ds", "--quiet") == 0
    out = tmp_path / "demo.html"
    assert cli_exit_code("view", tmp_path / "ds", "--model", policy, "--out", out, "-q") == 0
    root = dom(out.as_uri())
    rows = _rows_by_key(root)
    logged = {(row["group_id"], row["sample_index"]): row for group in open_dataset(tmp_path / "ds").iter_groups()
              for row in group}
    assert rows.keys() == logged.keys() and len(rows) == 16  # every group on the first page
    for key, row in rows.items():
        (completion,) = row.find_all("div", "completion")
        tokens = completion.find_all("span", "tok")
        assert len(tokens) == len(logged[key]["completion_ids"])
        assert all("rho" in token.attrs["title"] for token in tokens)  # the policy's ratio on every token
        head = row.find_all("div", "row-head")[0].text()
        assert f"reward {logged[key]['reward']:.3f}" in head and "advantage " in head


def test_page_files_load_whatever_the_page_is_named(page):
    out, _ = page
    odd = out.parent / "my view #1 ?.html"
    assert cli_exit_code("view", out.parent / "ds", "--out", odd, "--groups-per-page", 2, "-q") == 0
    assert (out.parent / "my view #1 ?_files" / "page-00001.js").exists()
    root = dom(odd.as_uri() + "#page=1")
    assert [s.attrs["data-group"] for s in root.find_all("section", "group")] == ["g-cut", "g-fill-0"]


def test_clicking_through_pages_filters_and_colours(page):
    """A user's session, driven through chromedriver: next page, a filter typed in, the colour switched, a prompt
    opened; the completion's script never ran (it would set window.pwned)."""
    from support.webdriver_support import Browser, driver_binaries

    if driver_binaries() is None:
        missing("chromedriver")
    out, _ = page
    groups = "return [...document.querySelectorAll('section.group')].map((s) => s.dataset.group).join(' ')"
    with Browser() as browser:
        browser.open(out.as_uri())
        browser.wait_for("return document.body.dataset.rendered")
        assert browser.run("return [document.title, typeof window.pwned]") == ["offline-rec view: ds", "undefined"]
        browser.click("#next")  # page 1 comes from its page file
        assert browser.wait_for(groups + " === 'g-cut g-fill-0' && location.hash")
        browser.type("#f-rmin", "0.3")
        browser.type("#f-rmax", "0.4")
        browser.click("button[type=submit]")
        browser.wait_for(groups + " === 'g-tool'")  # mean reward 0.375 only
        assert browser.run("return document.getElementById('status').textContent") == "1 of 8 groups match"
        assert browser.run("return location.hash") == "#rmin=0.3&rmax=0.4"
        token = "return document.querySelector('section.group .completion .tok:not(.env)').style.backgroundColor"
        by_ratio = browser.run(token)
        browser.run("const s = document.getElementById('colour-by'); s.value = 'behavior';"
                    "s.dispatchEvent(new Event('change'));")
        by_behavior = browser.wait_for(token.replace("return ", "const c = ") + f"; return c !== {by_ratio!r} && c")
        assert by_ratio.startswith("rgba(") and by_behavior.startswith("rgb(")  # the two colour scales
        assert browser.run("return document.querySelector('details.prompt').open") is False
        browser.click("details.prompt summary")
        assert browser.run("return document.querySelector('details.prompt').open") is True
        assert browser.run("return [document.title, typeof window.pwned]") == ["offline-rec view: ds", "undefined"]
