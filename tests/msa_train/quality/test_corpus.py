"""The site-packages corpus builder and its tokenizer (msa_train/quality/corpus.py) on a fake site-packages."""
import json

from msa_train.quality.corpus import build_corpus, package_of, split_packages


def _lines(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_split_by_package_counts_and_determinism(tiny_corpus, tmp_path):
    site, corpus, manifest = tiny_corpus
    train, held = _lines(corpus / "train.jsonl"), _lines(corpus / "heldout.jsonl")
    pk = manifest["packages"]
    assert set(pk["train"]) | set(pk["heldout"]) == {"alpha", "beta_pkg", "gamma", "delta"}
    assert not set(pk["train"]) & set(pk["heldout"]) and pk["heldout"]

    def packages(docs):  # from the file headers: "# ===== <entry>/<path> ====="
        return {package_of(h.split("/")[0]) for d in docs for h in d.split("# ===== ")[1:]}

    assert packages(train) == set(pk["train"]) and packages(held) == set(pk["heldout"])
    everything = "".join(train + held)
    assert "fake package for tests" in everything and "blob.bin" not in everything and "RECORD" not in everything
    assert "delta-1.0.dist-info/LICENSE" in "".join(held if "delta" in pk["heldout"] else train)  # with its package
    assert manifest["documents"] == {"train": len(train), "heldout": len(held)}
    assert manifest["chars"] == {"train": sum(map(len, train)), "heldout": sum(map(len, held))}
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(corpus / "tokenizer"))
    assert manifest["tokens"]["train"] == sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in train)
    assert manifest["files"]["train.jsonl"]["bytes"] == (corpus / "train.jsonl").stat().st_size
    again = build_corpus(str(tmp_path / "again"), [str(site)], vocab_size=300, heldout_fraction=0.2)
    for name in ("train.jsonl", "heldout.jsonl", "tokenizer/tokenizer.json"):
        assert (tmp_path / "again" / name).read_bytes() == (corpus / name).read_bytes(), name
    assert {k: v for k, v in again.items() if k != "site_packages"} == \
        {k: v for k, v in manifest.items() if k != "site_packages"}
    capped = build_corpus(str(tmp_path / "capped"), [str(site)], max_tokens=30_000, vocab_size=300,
                          heldout_fraction=0.2)
    assert capped["tokens"]["train"] <= max(30_000, capped["tokens"]["train_doc_max"])
    assert capped["tokens"]["heldout"] == manifest["tokens"]["heldout"]


def test_tokenizer_round_trips_and_the_trainer_loads_it(tiny_corpus):
    from msa_train.data import DataConfig, build_tokenizer

    _, corpus, manifest = tiny_corpus
    tok = build_tokenizer(DataConfig(format="pretrain", path=str(corpus / "train.jsonl"),
                                     tokenizer=str(corpus / "tokenizer")))
    from transformers import PreTrainedTokenizerFast

    assert isinstance(tok, PreTrainedTokenizerFast) and len(tok) == manifest["vocab_size"] == 300
    assert len(PreTrainedTokenizerFast.from_pretrained(str(corpus / "tokenizer"))) == 300
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    text = _lines(corpus / "heldout.jsonl")[0][:3000] + "\n\tünïcode ✓ 12345  \n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges learnt, and lossless
    assert tok.convert_tokens_to_ids("<|eos|>") not in ids


def test_split_rules():
    assert package_of("numpy-2.1.0.dist-info") == "numpy" and package_of("six.py") == "six"
    assert package_of("typing_extensions-4.0.dist-info") == package_of("typing_extensions.py")
    train, held = split_packages({"torch": 1000, "a": 10, "b": 10, "c": 10}, 0.05, seed=0)
    assert "torch" in train and held and not set(train) & set(held)
