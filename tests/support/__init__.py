"""The tests' shared helpers, one module a job, each written once: `from support.datagen import write_dataset`.

One package under tests/ (pyproject's pytest `pythonpath = ["tests"]` puts that folder on sys.path, and the
tests that start child processes pass it on through PYTHONPATH), so that no helper's bare module name (`paths`,
`datagen`, ...) can clash with an installed package's. tests/conftest.py registers the package for pytest's
assertion rewriting.
"""
