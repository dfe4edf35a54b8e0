"""--model as a GGUF file or a folder holding one (converted once into a cached plain folder), and the
one-line errors for model paths that exist nowhere. The real conversion of a real GGUF file is tested in
tests/models/test_real_model.py (slow)."""

import os
import sys

import pytest

from offline_rec.errors import UserError
from offline_rec.models import gguf, loading
from offline_rec.models.loading import could_be_hub_id, load_model, load_tokenizer, model_source
from offline_rec.models.tiny import make_tiny_checkpoint


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    """write_plain_model replaced by copying a tiny checkpoint (no gguf parsing); records each conversion."""
    tiny = make_tiny_checkpoint(tmp_path / "tiny", hidden_size=64, num_layers=1, num_heads=2)
    calls = []

    def write(gguf_path, out):
        calls.append(gguf_path)
        for name in os.listdir(tiny):
            (out / name).write_bytes((tmp_path / "tiny" / name).read_bytes())

    monkeypatch.setattr(gguf, "write_plain_model", write)
    monkeypatch.setenv("OFFLINE_REC_CACHE", str(tmp_path / "cache"))
    return calls


def test_a_gguf_file_or_its_folder_is_converted_once_and_loads(tmp_path, fake_conversion):
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "m.Q4.gguf").write_bytes(b"GGUF")
    (folder / "README.md").write_text("not a model")
    converted = model_source(str(folder / "m.Q4.gguf"))
    assert converted.startswith(str(tmp_path / "cache" / "models" / "m.Q4-"))
    assert model_source(str(folder)) == converted  # the folder holding it: the same conversion
    assert len(fake_conversion) == 1  # the second call found the cache
    tokenizer, model = load_tokenizer(str(folder)), load_model(str(folder / "m.Q4.gguf"))
    assert model.config.vocab_size == len(tokenizer)
    os.utime(folder / "m.Q4.gguf", ns=(1, 1))  # a changed file is converted again
    assert model_source(str(folder)) != converted and len(fake_conversion) == 2


def test_a_folder_with_several_gguf_files_asks_for_one(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(UserError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\); name the one to use, e.g. --model"):
        model_source(str(tmp_path))


def test_without_the_gguf_package_the_extra_is_named(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("OFFLINE_REC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "gguf", None)  # how a missing package is simulated (errors.require_extra)
    with pytest.raises(UserError, match=r"is a GGUF file: reading it needs gguf: pip install \"offline-rec\[gguf\]\""):
        load_tokenizer(str(tmp_path / "m.gguf"))


@pytest.mark.parametrize("name, hub_id", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("gpt2", True), ("run_full/final", True),
    ("./run_full/final", False), ("/abs/model", False), ("~/model", False), ("a/b/c", False),
    ("model.gguf", False), ("has space/x", False),
])
def test_what_could_be_a_hub_id(name, hub_id):
    assert could_be_hub_id(name) is hub_id


@pytest.mark.parametrize("name", ["a/b/c", "./nowhere", "x.Q4_1.gguf", "/no/such/model"])
def test_a_path_that_exists_nowhere_is_one_line_naming_it(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for load in (load_tokenizer, load_model):
        with pytest.raises(UserError, match=f"^model {name} does not exist$"):
            load(name)


def test_a_hub_id_that_cannot_be_reached_says_both(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no run_full/ here
    offline = OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them "
                      "in the cached files.\nCheck your internet connection")

    def unreachable(*args, **kwargs):
        raise offline

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreachable)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", unreachable)
    for load, what in ((load_tokenizer, "a tokenizer"), (load_model, "a causal LM")):
        with pytest.raises(UserError) as error:
            load("run_full/final")
        message = str(error.value)
        assert message == (f"cannot load {what} from run_full/final: there is no such local folder or file, and as "
                           "a Hugging Face Hub id: We couldn't connect to 'https://huggingface.co' to load the files, "
                           "and couldn't find them in the cached files.")


def test_a_file_that_is_not_gguf_and_a_folder_without_config_are_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UserError, match=r"is a file: give a model folder \(save_pretrained\) or a .gguf file"):
        loading.load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(UserError, match="has no config.json .* or a folder holding a .gguf file"):
        loading.load_model(str(tmp_path))
