"""Packing invariants, on the generated corpus and on hand-made documents."""
import numpy as np
import pytest
import torch

from msa_train.data import IGNORE_INDEX, DataConfig, build_packed_dataset, collate_packed, generate_corpus
from msa_train.data.packing import plan_packing


def check_item(item, T):
    """The packed-item contract of docs/data.md; returns the segment boundaries."""
    assert set(item) == {"input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "num_tokens"}
    for k in ("input_ids", "labels", "position_ids"):
        assert item[k].dtype == torch.int64 and item[k].shape == (T,), k
    cu = item["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == T
    assert (cu[1:] > cu[:-1]).all(), f"cu_seqlens not increasing: {cu}"
    lens = (cu[1:] - cu[:-1]).tolist()
    assert item["max_seqlen"] == max(lens) and isinstance(item["max_seqlen"], int)
    # document tokens: everything before the padding tail, itself one segment that nothing trains on
    n = item["num_tokens"]
    assert isinstance(n, int) and 0 < n <= T and n in cu.tolist(), (n, cu)
    assert n == T or (cu[-2] == n and (item["labels"][n:] == IGNORE_INDEX).all())
    pos, lab = item["position_ids"], item["labels"]
    for s, n in zip(cu[:-1].tolist(), lens):
        assert torch.equal(pos[s:s + n], torch.arange(n)), "position_ids must restart at every segment"
        assert lab[s] == IGNORE_INDEX, "a segment's first label would be predicted across the boundary"
    trained = lab != IGNORE_INDEX
    assert torch.equal(lab[trained], item["input_ids"][trained]), "labels are input_ids (HF, unshifted) or -100"
    return cu.tolist()


@pytest.mark.parametrize("T", [63, 111, 1000, 4096], ids=lambda T: f"T{T}")
def test_generated_packing_invariants(T, tok):
    cfg = DataConfig(num_docs=16, min_doc_tokens=100, max_doc_tokens=2500, seed=3)
    ds = build_packed_dataset(cfg, tok, T)
    placed = 0
    for i in range(len(ds)):
        item = ds[i]
        cu = check_item(item, T)
        # Every segment but a padding tail ends with EOS or is a full-length piece of a longer document.
        ids = item["input_ids"]
        for s, e in zip(cu[:-1], cu[1:]):
            is_pad = bool((ids[s:e] == tok.pad_token_id).all())
            assert is_pad or ids[e - 1] == tok.eos_token_id or (e - s) == T
            if is_pad:
                assert e == T and (item["labels"][s:e] == IGNORE_INDEX).all()
            else:
                placed += e - s
    assert placed == ds.num_tokens
    # BOS + characters + EOS per document, every token placed once.
    n_chars = sum(len(d) for d in generate_corpus(cfg))
    assert ds.num_tokens == n_chars + 2 * cfg.num_docs
    assert ds.padding_fraction < 0.25


def test_boundary_label_masking_exact(tok):
    """Two short documents in one sequence: exact ids, labels, positions and cu_seqlens."""
    ds = _pretrain_dataset(tok, ["ab", "xyz"], T=16)
    assert len(ds) == 1
    item = ds[0]
    bos, eos, pad = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    docs = {(bos, 97, 98, eos), (bos, 120, 121, 122, eos)}
    cu = item["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == 16 and len(cu) == 4
    segs = [tuple(item["input_ids"][s:e].tolist()) for s, e in zip(cu[:-1], cu[1:])]
    assert set(segs[:2]) == docs and segs[2] == (pad,) * (16 - 9)
    for s, e in zip(cu[:-2], cu[1:-1]):
        # HF shift: labels[s] is the target of position s-1 (the previous document's EOS): masked.
        assert item["labels"][s] == IGNORE_INDEX
        assert item["labels"][s + 1:e].tolist() == item["input_ids"][s + 1:e].tolist()
        assert item["labels"][e - 1] == eos  # the end of a document is trained
    assert (item["labels"][9:] == IGNORE_INDEX).all()
    assert item["position_ids"].tolist() == list(range(cu[1])) + list(range(cu[2] - cu[1])) + list(range(7))


def _pretrain_dataset(tok, texts, T, seed=0):
    import datasets

    from msa_train.data.packing import PackedDataset
    from msa_train.data.sources import column
    from msa_train.data.tokenization import tokenize_dataset
    tokens = tokenize_dataset(datasets.Dataset.from_dict({"text": texts}), "pretrain", tok)
    return PackedDataset(tokens, plan_packing(column(tokens, "length", numpy=True), T, seed), T, tok.pad_token_id)


@pytest.mark.parametrize("n_chars, T", [(250, 100), (298, 100), (299, 100), (1000, 63)],
                         ids=["remainder-52", "exact-3x", "remainder-1", "T63"])
def test_long_document_is_split_into_full_pieces(n_chars, T, tok):
    text = "".join(chr(97 + i % 26) for i in range(n_chars))
    ds = _pretrain_dataset(tok, [text], T)
    n_tokens = n_chars + 2
    assert len(ds) == -(-n_tokens // T)
    pieces = []
    for i in range(len(ds)):
        item = ds[i]
        cu = check_item(item, T)
        pieces.append(item["input_ids"][: cu[1]])
        if cu[1] < T:  # the remainder, followed by padding
            assert n_tokens % T == cu[1]
    # Reassembled in document order (full pieces start at multiples of T) they give the document back.
    by_start = {}
    doc = torch.tensor([tok.bos_token_id] + [ord(c) for c in text] + [tok.eos_token_id])
    for p in pieces:
        starts = [s for s in range(0, n_tokens, T) if torch.equal(doc[s:s + len(p)], p)]
        assert starts, "a piece is not a T-aligned slice of the document"
        by_start[starts[0]] = p
    assert torch.equal(torch.cat([by_start[s] for s in sorted(by_start)]), doc)


def test_packing_plan_is_deterministic_and_complete():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 700, size=300)
    a, b = plan_packing(lengths, 256, seed=5), plan_packing(lengths, 256, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    assert not np.array_equal(plan_packing(lengths, 256, seed=6).doc, a.doc)
    per_seq = np.add.reduceat(a.length, a.seq_ptr[:-1])
    assert (per_seq <= 256).all()
    covered = np.zeros(len(lengths), dtype=np.int64)
    np.add.at(covered, a.doc, a.length)
    assert np.array_equal(covered, lengths)
    assert 1 - a.length.sum() / (len(a) * 256) < 0.05  # best-fit leaves little padding


def test_build_is_deterministic_given_seed(tok):
    cfg = DataConfig(num_docs=8, min_doc_tokens=100, max_doc_tokens=900, seed=1)
    a, b = build_packed_dataset(cfg, tok, 256), build_packed_dataset(cfg, tok, 256)
    assert len(a) == len(b)
    for i in range(len(a)):
        assert all(torch.equal(a[i][k], b[i][k]) for k in ("input_ids", "labels", "cu_seqlens"))


@pytest.mark.parametrize("B", [1, 3], ids=lambda B: f"B{B}")
def test_collate_offsets_cu_seqlens(B, tok):
    ds = build_packed_dataset(DataConfig(num_docs=8, min_doc_tokens=100, max_doc_tokens=500), tok, 128)
    items = [ds[i] for i in range(B)]
    batch = collate_packed(items)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (B, 128)
    cu = batch["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == B * 128 and (cu[1:] > cu[:-1]).all()
    expected = [0] + [c + b * 128 for b, it in enumerate(items) for c in it["cu_seqlens"][1:].tolist()]
    assert cu.tolist() == expected
    assert batch["max_seqlen"] == max(it["max_seqlen"] for it in items)


def test_collate_rejects_mixed_lengths(tok):
    ds_a = build_packed_dataset(DataConfig(num_docs=2), tok, 128)
    ds_b = build_packed_dataset(DataConfig(num_docs=2), tok, 64)
    with pytest.raises(ValueError, match="collate_packed: item 1 has length"):
        collate_packed([ds_a[0], ds_b[0]])
