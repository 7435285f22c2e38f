import pytest

from smallstate_lm.data import BucketBatcher, split_long
from smallstate_lm.errors import DataError
from smallstate_lm.files import read_sentences
from smallstate_lm.state import pad_batch


def _seqs(n=300, seed=0):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 50) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def test_each_epoch_covers_every_sentence_once_within_the_token_budget():
    seqs = _seqs()
    b = BucketBatcher(seqs, batch_tokens=200, seed=3)
    seen = []
    for step in range(len(b)):
        epoch, batch = b.batch(step)
        assert epoch == 0
        tokens, lengths = pad_batch(batch)
        assert tokens.numel() <= 200
        assert max(lengths) - min(lengths) <= 10  # bucketed: similar lengths together
        seen.extend(map(tuple, batch))
    assert sorted(seen) == sorted(map(tuple, seqs))


def test_batch_order_is_reshuffled_per_epoch_and_reproducible():
    seqs = _seqs()
    a, b = BucketBatcher(seqs, 200, seed=3), BucketBatcher(seqs, 200, seed=3)
    n = len(a)
    assert [a.batch(i)[1] for i in range(2 * n)] == [b.batch(i)[1] for i in range(2 * n)]
    assert [a.batch(i)[1] for i in range(n)] != [a.batch(n + i)[1] for i in range(n)]


def test_split_long_keeps_all_tokens():
    seqs = [list(range(10)), [1, 2]]
    assert split_long(seqs, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [1, 2]]


def test_non_utf8_text_is_a_data_error(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt.*UTF-8"):
        read_sentences(p)
