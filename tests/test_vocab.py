import pytest

from smallstate_lm.errors import VocabularyError
from smallstate_lm.vocab import BOS_ID, EOS_ID, UNK_ID, EncodeStats, Vocabulary

SENTS = [["the", "lord", "said"], ["The", "lord", "spoke"], ["and", "the", "lord"]]


def test_specials_have_fixed_ids_and_words_sort_by_count():
    v = Vocabulary.build(SENTS)
    assert v.words[:3] == ["<s>", "</s>", "<unk>"]
    assert (v.index["<s>"], v.index["</s>"], v.index["<unk>"]) == (BOS_ID, EOS_ID, UNK_ID)
    assert v.words[3] == "lord"  # the most frequent word comes first


def test_min_count_max_size_and_lowercase():
    assert "spoke" not in Vocabulary.build(SENTS, min_count=2)
    assert len(Vocabulary.build(SENTS, max_size=5)) == 5
    low = Vocabulary.build(SENTS, lowercase=True)
    assert "The" in low and "the" in low  # folding applies to lookups too
    assert low.encode(["THE"]) == low.encode(["the"]) != [UNK_ID]


def test_oov_mapping_counts_oovs():
    v = Vocabulary.build(SENTS)
    stats = EncodeStats()
    ids = v.encode(["the", "pharaoh", "lord", "moses"], stats)
    assert ids[1] == ids[3] == UNK_ID and ids[0] != UNK_ID
    assert (stats.words, stats.oov, stats.oov_rate) == (4, 2, 0.5)


def test_save_load_round_trip(tmp_path):
    v = Vocabulary.build(SENTS, lowercase=True)
    v.save(tmp_path / "vocab.txt")
    w = Vocabulary.load(tmp_path / "vocab.txt")
    assert w.words == v.words and w.lowercase


def test_malformed_vocabulary_file_names_the_file(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_text("hello\nworld\n")
    with pytest.raises(VocabularyError, match="bad.txt"):
        Vocabulary.load(p)
    p.write_text("<s>\n</s>\n<unk>\na\na\n")
    with pytest.raises(VocabularyError, match="repeats"):
        Vocabulary.load(p)
    with pytest.raises(VocabularyError, match="not found"):
        Vocabulary.load(tmp_path / "missing.txt")


def test_building_from_no_words_is_an_error():
    with pytest.raises(VocabularyError):
        Vocabulary.build([["<s>"]])
