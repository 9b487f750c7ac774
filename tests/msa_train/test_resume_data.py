"""A resume refuses data files that changed since the checkpoint, unless data.allow_changed=true."""
import json

import pytest

from tests.msa_train._util import compose, train


def test_resume_refuses_changed_data_files_unless_allowed(tmp_path):
    from msa_train.trainer import Trainer

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(16)))
    args = ["attention=full", "train.steps=1", "train.seq_len=128", "train.progress=false", "train.save_hf=false",
            "data.format=pretrain", f"data.path={docs}", f"train.output_dir={tmp_path / 'run'}"]
    train(args)
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert state["run_config"]["data_files"][0]["size"] == docs.stat().st_size
    with docs.open("a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    resume = [*args, "train.steps=2", "train.resume=auto"]
    with pytest.raises(ValueError, match=rf"train.resume: the data changed since checkpoint .*step_000001 was "
                                         rf"written \({docs} changed\).*data.allow_changed=true"):
        Trainer(compose(resume))
    summary, _ = train([*resume, "data.allow_changed=true"])
    assert summary["resumed_from"].endswith("step_000001") and summary["steps"] == 2


def test_fingerprint_is_size_and_the_first_and_last_mib(tmp_path):
    from msa_train.data import DataConfig
    from msa_train.data.sources import data_fingerprint

    path = tmp_path / "big.txt"
    path.write_bytes(b"a" * (3 << 20))
    cfg = DataConfig(format="pretrain", path=str(path))
    before = data_fingerprint(cfg)
    with path.open("r+b") as f:
        f.seek((3 << 20) - 10)
        f.write(b"b")  # in the last MiB, same size
    assert data_fingerprint(cfg) != before
    with path.open("r+b") as f:
        f.seek((3 << 20) - 10)
        f.write(b"a")
    path.touch()  # a new mtime alone (a copy) is not a change
    assert data_fingerprint(cfg) == before
