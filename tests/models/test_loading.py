"""models.loading's vocabulary checks: the one place each "does not fit" refusal is made."""

import pytest

from offline_rec.errors import UserError
from offline_rec.models.loading import (
    check_model_tokenizer,
    check_token_ids_fit,
    check_tokenizer_fits,
    config_vocab_size,
    embedding_rows,
    load_model,
    load_tokenizer,
)
from offline_rec.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("loading") / "model", hidden_size=64, num_layers=1,
                                num_heads=2)


def test_the_config_and_the_loaded_model_agree_on_the_rows(tiny):
    model, tokenizer = load_model(tiny), load_tokenizer(tiny)
    assert config_vocab_size(tiny) == embedding_rows(model) == len(tokenizer)
    check_model_tokenizer(model, tokenizer)  # fits exactly


def test_a_tokenizer_larger_than_the_embedding_is_refused_with_both_sizes():
    tokenizer = list(range(11))  # anything with a len()
    check_tokenizer_fits(tokenizer, 11)
    check_tokenizer_fits(tokenizer, None)  # unknown rows: accepted
    with pytest.raises(UserError, match=r"tokenizer of m has 11 tokens but the model's embedding has 10 rows"):
        check_tokenizer_fits(tokenizer, 10, " of m")


def test_a_token_id_without_an_embedding_row_is_refused():
    check_token_ids_fit(9, 10, "m")
    check_token_ids_fit(10**6, None, "m")
    with pytest.raises(UserError, match=r"token id 10 but m has 10 embeddings: data and model do not match"):
        check_token_ids_fit(10, 10, "m")


def test_an_unreadable_config_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot read the model config"):
        config_vocab_size(str(tmp_path))
