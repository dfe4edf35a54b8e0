"""`offline-rec view`: a dataset in the browser, one response token by token.

- config.py: `ViewConfig`, every option once;
- rows.py: the group index (one pass over a few columns), pages of rows read on demand, token text
  from the tokenizer's bytes, advantages, and with a policy its ratios and clip mask;
- page.py: the self-contained HTML page and its page files (`write_view`);
- assets.py: the page's inline style and script;
- serve.py: the page on a local HTTP server (`serve_view`).
"""
