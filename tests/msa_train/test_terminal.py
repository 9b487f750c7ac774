"""What a run prints: rank 0 speaks for the run; known-harmless library warnings are filtered."""
import logging

from msa_train.metrics import log_on_rank_zero_only


def test_ranks_other_than_zero_log_errors_only(caplog):
    data_log = logging.getLogger("msa_train.data.dataset")
    try:
        log_on_rank_zero_only(1)
        with caplog.at_level(logging.INFO):
            data_log.info("data summary")
            data_log.warning("data warning")
            data_log.error("data error")
        assert "data summary" not in caplog.text and "data warning" not in caplog.text
        assert "data error" in caplog.text
    finally:
        for name in ("msa_train", "DeepSpeed"):
            logging.getLogger(name).setLevel(logging.NOTSET)


def test_the_cpu_accelerator_warning_is_dropped_by_message_only():
    from msa_train.cli import _DropMessage

    f = _DropMessage("Setting accelerator to CPU")
    rec = lambda msg: logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1, msg, None, None)
    assert not f.filter(rec("Setting accelerator to CPU. If you have GPU ..."))
    assert f.filter(rec("total_num_steps 3 is less than warmup_num_steps 5"))
